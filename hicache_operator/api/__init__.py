"""API vocabulary: the HiCacheDeployment spec and status types, conditions, rules, flags and labels.

The bottom layer: it imports nothing else of the operator.
"""
