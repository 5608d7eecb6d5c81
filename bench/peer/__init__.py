"""The peer tier between real sidecars on loopback (tier) next to raw TCP
between two processes (rawtcp); where a fetch's threads spend their time
(stacks, with ``--profile``).
"""
