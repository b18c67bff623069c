# `make demo` and `make test` each set up .venv first (scripts/setup.sh finds a Python >= 3.12).
.PHONY: setup demo demo-vlm demo-moe test gpu-check

setup:
	scripts/setup.sh

demo:
	scripts/setup.sh --demo
	.venv/bin/jaxft-train examples/quickstart.yaml overwrite_output_dir=true

# The vision-language example: a LoRA on the tiny random Qwen2-VL over synthetic pictures (examples/vlm.yaml).
demo-vlm:
	scripts/setup.sh --demo
	.venv/bin/jaxft-train examples/vlm.yaml overwrite_output_dir=true

# The MoE example: attention and expert adapters on the tiny random Qwen3-MoE (examples/moe.yaml).
demo-moe:
	scripts/setup.sh --demo
	.venv/bin/jaxft-train examples/moe.yaml overwrite_output_dir=true

# The whole CPU suite (GPU tests are skipped here; scripts/gpu_check.sh runs them on the device): two pytest-xdist
# workers, a test file at a time each (a file's module-scoped fixtures, mostly compiles, then run once), files with
# slow tests first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order, where xdist would start
# the files with the most tests first); the 20 slowest tests are listed at the end.
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

gpu-check:
	bash scripts/gpu_check.sh
