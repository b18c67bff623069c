"""Tools users and maintainers run from the repository root: the set-up, the example makers, the GPU check and the
training benchmark (`python -m scripts.bench.train`). Not installed with jaxft; the lab's probes live in
experiments/."""
