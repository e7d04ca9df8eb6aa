"""The serving engine: one thread steps it, everything else talks to it through queues.

``loop`` (``Engine``: the engine thread, inbox, step), ``scheduler`` (admission and batch
composition, policy only), ``runner`` (``ModelRunner``: one TP rank's model and KV pools, the
same class on every rank), ``tp`` (the transport to the TP followers, which run a ``ModelRunner``
each), ``requests`` (``Request``, ``Output``), ``stats`` (the counters metrics read) and
``storage_admin`` (L3 attach, detach, status and clear, at boot and over HTTP).
"""
