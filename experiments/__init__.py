"""The lab: probes, sweeps, ablations and one-off device scripts (README.md). Not installed, imported by nothing
outside it; its modules run from the repository root as `python -m experiments.<folder>.<module>`."""
