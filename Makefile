# `make demo` and `make test` each set up .venv first (scripts/setup.sh finds a Python >= 3.12).
.PHONY: setup demo test test-fast gpu-check

setup:
	scripts/setup.sh

demo:
	scripts/setup.sh --demo
	.venv/bin/jaxft-train examples/quickstart.yaml overwrite_output_dir=true

test: setup
	.venv/bin/python -m pytest -q tests

gpu-check:
	bash scripts/gpu_check.sh
