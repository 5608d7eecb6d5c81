"""The fleet as an operator runs it: real engines behind ``tierstore gateway``.

- ``run``: the bench (``python -m bench.fleet.run --json``): five placement
  modes on one open-loop schedule, the gateway's overhead and a failover;
- ``topology``: deploy/kubernetes/tierstore.yaml's topology on one machine
  (pods as network namespaces on a shaped bridge, etcd, the gateway);
- ``workload``: the seeded, skewed multi-turn chat schedule.
"""
