"""Pure planning: spec + observed state -> validation findings, sizing, rendered children, status.

No I/O: every function takes what it reads as arguments. Imports ``api`` and ``fleet`` only.
"""
