"""The GPU figures of the engine's copy path (copy_path) and the one-shot GPU
device check (check; bench/gpu_check.sh runs it, wheels.sh fills its wheels).
"""
