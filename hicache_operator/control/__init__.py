"""Control: kopf registration, the controller and its work queue, informers, failures, and the
reconcile pipeline (``pipeline``; its phases' writes and reads in ``children``, ``stepping``,
``problems``). The top of the operator; only ``tools`` and ``__main__`` sit above it.
"""
