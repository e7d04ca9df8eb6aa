"""I/O: the Kubernetes client, the operator's metrics, and model-download progress reads.

Imports ``api``, ``fleet`` and ``plan``; never ``rollout`` or ``control``.
"""
