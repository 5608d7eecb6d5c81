"""Two hosts in network namespaces, shaped links and session switches
(run: the real benchmark and the pure fleet simulation; real, hosts, driver:
the real run's pieces; workload, sim: sessions, placement and the simulation;
diag: why a switch was not warm; charts).
"""
