"""Group membership: which sidecars (and their engines) make up the group now.

- ``members``: the ``MemberSet`` protocol every user asks (``addresses``,
  ``version``), ``StaticMembers`` (a configured list) and the ``Member``
  record a sidecar publishes; pure.
- ``etcd``: ``EtcdMembers``, the live set from etcd leases (register under
  a lease, watch the group).
- ``etcd_client``: a small synchronous client of etcd's v3 gRPC API.

Used by the peer tier (``tierstore.peer``), the router and the gateway;
imports nothing of the store, the sidecar or the peer tier.
"""
