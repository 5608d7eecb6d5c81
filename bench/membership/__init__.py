"""Group membership on a real etcd: how long a dead member keeps receiving
pushes (churn), and the choice of etcd client (etcd_clients).
"""
