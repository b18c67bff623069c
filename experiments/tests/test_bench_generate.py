"""experiments/probes/bench_generate.py (decode throughput, jaxft.generate vs transformers' generate) end to end on
the tiny shape on the CPU: both systems decode the asked tokens and the table names them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_generate_runs_on_the_tiny_shape(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.probes.bench_generate", "--shapes", "tiny",
                           "--systems", "jaxft,hf", "--batch", "2", "--prompt-len", "16", "--new-tokens", "6",
                           "--workdir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["jaxft", "transformers"]
    for r in rows:
        assert r["batch"] == 2 and r["new_tokens"] == 6
        for key in ("prefill_s", "decode_s", "decode_tokens_per_s"):
            assert r[key] > 0, (key, r)
    assert "| tiny-llama | jaxft | 2 |" in proc.stdout
