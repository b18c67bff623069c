"""experiments/probes/bench_scaling.py (issue #15's scaling table) on 2 host CPU devices: a process per point, the mesh
each point asked for, the global batch growing with the devices, the same first loss for dp and fsdp on the same
rows, efficiency against the one-device row, and the table; HF+PEFT points under accelerate (DDP over 2 CPU
processes with gloo; FSDP, which accelerate runs on GPUs only, refused in one line)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from scripts.bench.workloads import SHAPES  # noqa: E402
from experiments.probes.bench_scaling import _point_in_a_process, markdown, point_row  # noqa: E402


@pytest.mark.slow  # three child processes, each compiling a tiny step
def test_points_run_on_their_meshes_and_agree_on_the_first_loss(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [sys.executable, "-m", "experiments.probes.bench_scaling", "--workload", "tiny_llama", "--devices", "1,2",
           "--systems", "jaxft", "--steps", "2", "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["system"], r["mesh"], r["devices"], r["status"]) for r in rows] == [
        ("jaxft", "dp", 1, "ok"), ("jaxft", "dp", 2, "ok"), ("jaxft", "fsdp", 2, "ok")]
    assert [r["mesh_shape"] for r in rows] == [{"data": 1, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 1, "tensor": 1},
                                               {"data": 1, "fsdp": 2, "tensor": 1}]
    for r in rows:  # tiny_llama: 2 rows of 128 tokens per device; 2 timed steps after the warm-up
        assert r["tokens_per_step"] == 2 * 128 * r["devices"] and len(r["step_times_s"]) == 2 and len(r["losses"]) == 3
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_step"] / r["step_s"] / r["devices"])
        assert r["efficiency"] == pytest.approx(r["tokens_per_s_per_device"] / rows[0]["tokens_per_s_per_device"])
        assert r["peak_gib_per_device"] is None  # the CPU keeps no allocator statistics
        assert 0 < r["estimate_gib_per_device"] < 0.1 and r["wall_s"] > r["compile_s"]  # tiny Llama
    assert rows[0]["efficiency"] == 1.0
    dp, fsdp = rows[1]["losses"], rows[2]["losses"]
    assert dp[0] == pytest.approx(fsdp[0], rel=1e-5) and dp[-1] == pytest.approx(fsdp[-1], rel=1e-4)
    table = (tmp_path / "s.md").read_text().splitlines()
    assert table[0].endswith("`python -m experiments.probes.bench_scaling --workload tiny_llama --devices 1,2 "
                             f"--systems jaxft --steps 2 --json {tmp_path / 's.json'} --md {tmp_path / 's.md'}`")
    assert [line.split(" | ")[:3] for line in table[4:7]] == [["| jaxft", "dp", "1"], ["| jaxft", "dp", "2"],
                                                              ["| jaxft", "fsdp", "2"]]
    assert "n/a (CPU)" in table[5] and "100.0%" in table[4]


@pytest.mark.slow  # three torch child processes (two of them under torchrun)
def test_hf_points_run_under_accelerate_and_fsdp_on_a_cpu_is_refused_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.probes.bench_scaling", "--workload", "tiny_llama", "--devices", "1,2",
           "--systems", "hf_ckpt", "--steps", "2", "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md")]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900,
                         cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    one, dp, fsdp = json.loads((tmp_path / "s.json").read_text())
    assert [(r["system"], r["mesh"], r["devices"], r["status"]) for r in (one, dp, fsdp)] == [
        ("hf_ckpt", "dp", 1, "ok"), ("hf_ckpt", "dp", 2, "ok"), ("hf_ckpt", "fsdp", 2, "error")], [
        r.get("error") for r in (one, dp, fsdp)]
    assert (one["distributed_type"], dp["distributed_type"]) == ("NO", "MULTI_CPU")  # accelerate's DDP over gloo
    for r in (one, dp):  # tiny_llama: 2 rows of 128 tokens per process; 2 timed steps after the warm-up
        assert r["tokens_per_step"] == 2 * 128 * r["devices"] and len(r["step_times_s"]) == 2 and len(r["losses"]) == 3
        assert r["settings"]["gradient_checkpointing"] and r["peak_gib_per_device"] is None
        assert r["settings"]["fsdp_units"] is None  # DDP / one process: the model is not cut into FSDP units
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_step"] / r["step_s"] / r["devices"])
    assert one["efficiency"] == 1.0
    assert dp["efficiency"] == pytest.approx(dp["tokens_per_s_per_device"] / one["tokens_per_s_per_device"])
    # transformers' random init (std 0.02) predicts nearly uniformly: every step's loss is about ln(vocab).
    vocab = SHAPES["tiny-llama"].get("vocab_size")
    assert all(abs(x - math.log(vocab)) < 0.1 for r in (one, dp) for x in r["losses"]), (one["losses"], dp["losses"])
    assert fsdp["error"] == ("bench_scaling_hf: fsdp on 2 CPU processes needs accelerate's FSDP, it chose MULTI_CPU "
                             "(accelerate shards with FSDP on GPUs only)")
    assert "| hf_ckpt | fsdp | 2 | error: bench_scaling_hf: fsdp" in (tmp_path / "s.md").read_text()


def test_a_bad_mesh_is_one_line():
    res = subprocess.run([sys.executable, "-m", "experiments.probes.bench_scaling", "--meshes", "dp,tp"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 1 and res.stderr.strip() == "bench_scaling: --meshes 'tp': use dp, fsdp"


def test_a_bad_system_is_one_line():
    res = subprocess.run([sys.executable, "-m", "experiments.probes.bench_scaling", "--systems", "jaxft,unsloth"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 1 and res.stderr.strip() == ("bench_scaling: --systems 'unsloth': use jaxft, hf_ckpt, "
                                                          "hf_nockpt")


def test_a_point_past_its_timeout_is_killed_whole_and_recorded(tmp_path):
    cmd = [sys.executable, "-m", "experiments.probes.bench_scaling", "--workload", "tiny_llama", "--devices", "1",
           "--systems", "jaxft", "--steps", "1", "--timeout", "2", "--json", str(tmp_path / "s.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "s.json").read_text())
    assert {k: row[k] for k in ("system", "mesh", "devices", "status", "error")} == {
        "system": "jaxft", "mesh": "dp", "devices": 1, "status": "timeout", "error": "over --timeout 2 s"}
    assert 2 <= row["wall_s"] < 30
    left = []  # no process of the point outlives it (it ran in a session of its own)
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"bench_scaling.py") for a in args) and b"--point" in args:
            left.append(args)
    assert not left, left


RENDEZVOUS = ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
              "has failed.")


def test_a_row_the_workers_wrote_is_kept_when_torchrun_then_fails_in_its_shutdown():
    written = {"system": "hf_ckpt", "mesh": "dp", "devices": 2, "step_s": 0.02}
    row = point_row("hf_ckpt", "dp", 2, 1, "", "Traceback ...\n" + RENDEZVOUS + "\n", written, {"wall_s": 9.0})
    assert row == {**written, "status": "ok", "wall_s": 9.0, "launcher_exit": "exit 1: " + RENDEZVOUS}
    assert point_row("hf_ckpt", "dp", 2, 0, "", "", written, {"wall_s": 9.0}) == {**written, "status": "ok",
                                                                                  "wall_s": 9.0}


def test_only_a_launcher_failure_before_the_workers_spoke_is_marked_for_a_second_try():
    def row(stderr):
        return point_row("hf_ckpt", "dp", 2, 1, "", stderr, None, {"wall_s": 3.0})

    assert row("a\nb\n" + RENDEZVOUS)["launcher_failed"]
    assert row("torch.distributed.DistNetworkError: ... EADDRINUSE")["launcher_failed"]
    # The worker said why (its own line), a plain crash, or an OOM: a second try would only repeat it.
    own = row("bench_scaling_hf: dp on 2 CPU processes needs MULTI_CPU\n" + RENDEZVOUS)
    assert not own["launcher_failed"] and own["error"] == "bench_scaling_hf: dp on 2 CPU processes needs MULTI_CPU"
    crash = row("Traceback\n  File x\nValueError: bad shape")
    assert not crash["launcher_failed"] and crash["error"] == "Traceback |   File x | ValueError: bad shape"
    oom = row("torch.OutOfMemoryError: CUDA out of memory.\n" + RENDEZVOUS)
    assert oom["status"] == "oom" and not oom["launcher_failed"]


def test_a_launcher_failure_runs_the_point_once_more_and_the_row_says_so():
    tries = []

    def once(args, system, mesh, devices):
        tries.append((system, mesh, devices))
        if len(tries) == 1:
            return point_row(system, mesh, devices, 1, "", RENDEZVOUS, None, {"wall_s": 1.0})
        return point_row(system, mesh, devices, 0, "", "", {"step_s": 0.02}, {"wall_s": 2.0})

    row = _point_in_a_process(None, "hf_ckpt", "dp", 2, once=once)
    assert tries == [("hf_ckpt", "dp", 2)] * 2
    assert row == {"step_s": 0.02, "status": "ok", "wall_s": 2.0, "retried_after": RENDEZVOUS}

    def always(args, system, mesh, devices):  # a second launcher failure is the row: no third try
        tries.append(system)
        return point_row(system, mesh, devices, 1, "", RENDEZVOUS, None, {"wall_s": 1.0})

    tries.clear()
    row = _point_in_a_process(None, "hf_ckpt", "dp", 2, once=always)
    assert len(tries) == 2 and row["status"] == "error" and row["retried_after"] == RENDEZVOUS
    assert "launcher_failed" not in row


def test_the_table_notes_a_retried_point_and_a_launcher_exit():
    ok = {"system": "hf_ckpt", "mesh": "dp", "devices": 2, "status": "ok", "step_s": 0.02, "tokens_per_s": 100.0,
          "tokens_per_s_per_device": 50.0, "efficiency": 0.9, "peak_gib_per_device": None, "losses": [6.25],
          "device_kind": "cpu"}
    table = markdown([{**ok, "retried_after": RENDEZVOUS}, {**ok, "devices": 4, "launcher_exit": "exit 1: Broken pipe"},
                      {**ok, "devices": 8}], ["--devices", "2,4,8"])
    notes = table.splitlines()[-2:]
    assert notes == ["- hf_ckpt dp 2: ran twice; the first try failed in torchrun's rendezvous: " + RENDEZVOUS,
                     "- hf_ckpt dp 4: the launcher failed after the row was written: exit 1: Broken pipe"]
    assert "ran twice" not in markdown([{**ok, "devices": 8}], [])
