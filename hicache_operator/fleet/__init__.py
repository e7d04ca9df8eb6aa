"""Shared fleet vocabulary: children's names, storage config and its fingerprint, the serving gate,
pod readings.

What planning, rollout and control all say about one fleet; imports only ``api``.
"""
