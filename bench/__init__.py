"""tierstore's benchmarks, grouped by what they measure (bench/README.md lists
each: its command, its baseline or physical limit, how long it runs, where its
figures are in the docs).

Run each from the repository root as a module, ``python -m
bench.<group>.<name> [--json]``: no benchmark puts a folder on ``sys.path``,
so none can stand for an installed package. ``bench.limits`` measures the
physical limits and prints the JSON every group uses; ``bench.plot`` charts
their output; the processes they start come from ``harness``.
"""
