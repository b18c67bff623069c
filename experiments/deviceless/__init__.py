"""Compiles for an H200 target on a CPU-only machine (gpu_compile.py): schedules and memory without a GPU."""
