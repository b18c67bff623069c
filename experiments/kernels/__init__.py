"""Kernel sweeps and kernels taken out of kernels_pallas's dispatch."""
