"""scripts/bench_scaling.py (issue #15's scaling table) on 2 host CPU devices: a process per point, the mesh
each point asked for, the global batch growing with the devices, the same first loss for dp and fsdp on the same
rows, efficiency against the one-device row, and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # three child processes, each compiling a tiny step
def test_points_run_on_their_meshes_and_agree_on_the_first_loss(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [sys.executable, str(REPO / "scripts" / "bench_scaling.py"), "--workload", "tiny_llama", "--devices", "1,2",
           "--steps", "2", "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["mesh"], r["devices"], r["status"]) for r in rows] == [("dp", 1, "ok"), ("dp", 2, "ok"),
                                                                       ("fsdp", 2, "ok")]
    assert [r["mesh_shape"] for r in rows] == [{"data": 1, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 1, "tensor": 1},
                                               {"data": 1, "fsdp": 2, "tensor": 1}]
    for r in rows:  # tiny_llama: 2 rows of 128 tokens per device; 2 timed steps after the warm-up
        assert r["tokens_per_step"] == 2 * 128 * r["devices"] and len(r["step_times_s"]) == 2 and len(r["losses"]) == 3
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_step"] / r["step_s"] / r["devices"])
        assert r["efficiency"] == pytest.approx(r["tokens_per_s_per_device"] / rows[0]["tokens_per_s_per_device"])
        assert r["peak_gib_per_device"] is None  # the CPU keeps no allocator statistics
    assert rows[0]["efficiency"] == 1.0
    dp, fsdp = rows[1]["losses"], rows[2]["losses"]
    assert dp[0] == pytest.approx(fsdp[0], rel=1e-5) and dp[-1] == pytest.approx(fsdp[-1], rel=1e-4)
    table = (tmp_path / "s.md").read_text().splitlines()
    assert table[0].endswith("`python scripts/bench_scaling.py --workload tiny_llama --devices 1,2 --steps 2 --json "
                             f"{tmp_path / 's.json'} --md {tmp_path / 's.md'}`")
    assert [line.split(" | ")[:2] for line in table[4:7]] == [["| dp", "1"], ["| dp", "2"], ["| fsdp", "2"]]
    assert "n/a (CPU)" in table[5] and "100.0%" in table[4]


def test_a_bad_mesh_is_one_line():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_scaling.py"), "--meshes", "dp,tp"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 1 and res.stderr.strip() == "bench_scaling: --meshes 'tp': use dp, fsdp"
