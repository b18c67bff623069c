#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 (JAX >= 0.11 needs it) and installs jaxft. Idempotent: a second run only
# checks. Usage: scripts/setup.sh [--demo | --no-hf]
#   (default)  jaxft + the test oracles (torch + peft, CPU use) + pytest + matplotlib: what `make test` needs
#   --demo     jaxft + matplotlib only: what `make demo` needs (no torch: about a minute less on a fresh machine)
#   --no-hf    jaxft alone
set -euo pipefail
cd "$(dirname "$0")/.."
extras="dev"
[ "${1:-}" = "--no-hf" ] && extras="plain"
[ "${1:-}" = "--demo" ] && extras="demo"

works() {  # a real interpreter >= 3.12 (pyenv shims of absent versions exit non-zero)
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${JAXFT_PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && works "$c" && { command -v "$c"; return; }
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)/versions")
  roots+=("$HOME/.pyenv/versions" /usr/local/bin /usr/bin /opt/python*/bin)
  for r in "${roots[@]}"; do
    for c in "$r"/3.1[3-9]*/bin/python3 "$r"/3.12*/bin/python3 "$r"/python3.1[2-9]; do
      [ -x "$c" ] && works "$c" && { echo "$c"; return; }
    done
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! works .venv/bin/python; then
  py=$(find_python) || { echo "setup: no Python >= 3.12 found (JAX >= 0.11 needs one). Install one, or set JAXFT_PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "setup: using $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.jaxft-installed-$extras
fresh() { [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]; }
# A dev install holds everything the demo needs.
if ! fresh "$stamp" && ! { [ "$extras" != "dev" ] && fresh .venv/.jaxft-installed-dev; }; then
  # PyPI's torch brings its CUDA libraries (about 7 GB installed with the rest); the others need about 1.5 GB.
  need_gb=2; [ "$extras" = "dev" ] && need_gb=8
  free_gb=$(df -Pk .venv | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gb:-0}" -lt "$need_gb" ]; then
    echo "setup: $(pwd)/.venv has ${free_gb} GB free; this install ($extras) needs about $need_gb GB. Free disk space there, or clone jaxft onto a larger disk" >&2
    exit 1
  fi
  # pip's downloads and build trees go on the venv's disk, not a small /tmp, and no wheel cache doubles them
  # (a CI install once died of ENOSPC while writing jaxft's editable wheel).
  mkdir -p .venv/pip-tmp
  extra=""; [ "$extras" != "plain" ] && extra="[$extras]"
  TMPDIR="$(pwd)/.venv/pip-tmp" .venv/bin/python -m pip install -q --no-cache-dir -c scripts/constraints.txt -e ".$extra"
  rm -rf .venv/pip-tmp
  touch "$stamp"
fi
.venv/bin/python -c "import jax, flax, jaxft; print('setup: ok — jax', jax.__version__, 'flax', flax.__version__, 'on', jax.devices()[0].platform)"
