"""Reliability tests: crashes, disk faults, network faults, overload and fuzzing
against real sidecars. The shared helpers are in ``harness``."""
