"""The peer tier between real sidecars on loopback (tier) next to raw TCP
between two processes (rawtcp).
"""
