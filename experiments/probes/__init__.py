"""Device probes, sweeps and ablations of jaxft (experiments/README.md)."""
