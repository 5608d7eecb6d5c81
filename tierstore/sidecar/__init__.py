"""The sidecar process (``tierstore serve``): the services around the store.

``process`` (start-up, the socket lock, signals, shutdown), ``service`` (the
engines' local gRPC service), ``clients`` (the attached engine clients),
``stat`` (Stat's reply, which ``tierstore stat`` and ``metrics`` read),
``fastpath`` (the lookup fast-path server), ``prefetch`` (policies and
workers), ``metrics`` (Prometheus), ``loadboard`` (the engines' reported
load). The peer port lives in ``tierstore.peer``.
"""
