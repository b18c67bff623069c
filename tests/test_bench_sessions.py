"""Tests of the training benchmark's worker sessions (scripts/bench/sessions.py, the workers' session loops and
scripts.bench.train's scheduling): several tasks per worker process, the reused base model, a session continued
after the task it died in, sessions side by side on several (fake) GPUs; and the report's memory marks and its
remat auto check.

Oracles: a fresh one-task run of the same task, a fake worker whose model directory's name picks what it does,
and the CLI run end to end on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from scripts.bench.report import markdown, summarise_run  # noqa: E402
from scripts.bench.workloads import SHAPES, get_workload  # noqa: E402
from scripts.bench.worker_common import Task, dump_session, worker_main  # noqa: E402

from bench_helpers import frozen_heap  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------
# Sessions: several tasks per worker process.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from scripts.bench.models import save_random_model

    path = str(tmp_path_factory.mktemp("models") / "tiny-llama")
    save_random_model(SHAPES["tiny-llama"], path, "cpu")
    return path


def _run_session(module: str, tasks: list[Task], tmp_path) -> list[dict]:
    """Run a worker module on a session task file in its own process (CPU only), as the harness does (`python -m`
    from a run folder, the repository on PYTHONPATH); its result list."""
    task_path, out = str(tmp_path / f"{module}.tasks.json"), str(tmp_path / f"{module}.results.json")
    dump_session(tasks, task_path)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-m", module, "--task", task_path, "--out", out],
                         capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        results = json.load(f)
    assert [r["session_index"] for r in results] == list(range(len(tasks)))
    assert [(r["system"], r["workload"]) for r in results] == [(t.system, t.workload) for t in tasks]
    return results


def test_hf_session_reuses_the_model_and_survives_a_failed_task(tiny_model_dir, tmp_path):
    """The torch worker's session loop in this process (its run in a process of its own, as the harness starts
    it: test_bench_train.py::test_tiny_pipeline_end_to_end_jaxft_and_hf_on_two_fake_gpus)."""
    from scripts.bench.torch_worker import run_task

    missing = str(tmp_path / "no_such_model")
    tasks = [Task("train", "hf_nockpt", wl, d, 3, "cpu") for wl, d in
             [("tiny_llama", tiny_model_dir), ("tiny_llama", missing), ("tiny_packed", tiny_model_dir),
              ("tiny_llama", tiny_model_dir)]] + [Task("train", "unsloth", "tiny_llama", tiny_model_dir, 3, "cpu")]
    task_path, out = str(tmp_path / "tasks.json"), str(tmp_path / "results.json")
    dump_session(tasks, task_path)
    with frozen_heap():
        assert worker_main(run_task, ["--task", task_path, "--out", out]) == 0
    with open(out) as f:
        res = json.load(f)
    assert [r["session_index"] for r in res] == list(range(len(tasks)))
    assert [(r["system"], r["workload"]) for r in res] == [(t.system, t.workload) for t in tasks]
    assert [r["status"] for r in res] == ["ok", "error", "ok", "ok", "not_run"]
    assert "no_such_model" in res[1]["error"]
    assert "Unsloth needs a CUDA GPU" in res[4]["error"]  # a row saying why, not a crash
    # The failed task dropped the cached model (task 3 reloads it); task 4 reuses task 3's load.
    assert [r.get("base_model_reused") for r in res] == [False, None, False, True, None]
    # A reused model, unloaded after a failed task and another workload's LoRA training, trains exactly like the
    # fresh process's first load (task 1: what a one-task run does).
    assert res[3]["data_sha256"] == res[0]["data_sha256"]
    np.testing.assert_allclose(res[3]["losses"], res[0]["losses"], rtol=1e-6)


def test_jaxft_session_matches_a_fresh_run_and_reports_its_memory(tiny_model_dir, tmp_path):
    tasks = [Task("train", "jaxft", wl, tiny_model_dir, 3, "cpu")
             for wl in ("tiny_llama", "tiny_packed", "tiny_llama")]
    res = _run_session("scripts.bench.jaxft_worker", tasks, tmp_path)
    assert [r["status"] for r in res] == ["ok", "ok", "ok"], [r.get("error") for r in res]
    assert [r["base_model_reused"] for r in res] == [False, True, True]
    # The 3rd task's reused frozen weights + re-copied LoRA init, after another workload trained on them, == the
    # process's first, fresh load (empty cache).
    np.testing.assert_allclose(res[2]["losses"], res[0]["losses"], rtol=1e-6)
    for r in res:
        analysis, mem = r["extra"]["memory_analysis"], r["extra"]["memory"]
        assert analysis["temp_size_in_bytes"] > 0 and analysis["output_size_in_bytes"] > 0
        assert isinstance(r["peak_memory_bytes"], int)
        # The CPU backend has no allocator statistics: the peak is the compiled step's estimate.
        assert r["peak_memory_source"] == "static_estimate"
        assert r["peak_memory_bytes"] == mem["static_estimate"] == mem["bytes_in_use_before_steps"] + \
            analysis["temp_size_in_bytes"] + analysis["output_size_in_bytes"] - analysis["alias_size_in_bytes"]
        # Read before the steps: beside the run's state at most a few scalars (a key) are alive, and the CPU has no
        # allocator statistics to compare with.
        outside = r["extra"]["resident_outside_state"]
        assert "in_use_beyond_state" not in outside
        assert 0 <= outside["bytes"] < 1024 and all(n <= 8 for _, _, n in outside["largest"]), outside


def test_jaxft_row_reports_the_settings_it_ran_with_after_remat_auto(tiny_model_dir):
    from scripts.bench import jaxft_worker

    # remat auto resolves on CPU to "none" (the tiny model fits), and "none" unrolls the layers: the row must say
    # so, not the unresolved config's "scan" (the Gemma auto_40gb row of 3fa6ed3 said "scan" for an unrolled run).
    with frozen_heap():
        raw = jaxft_worker.run_jaxft(get_workload("tiny_llama"), tiny_model_dir, 2, mode="auto")
    settings = raw["settings"]
    assert (settings["remat"], settings["remat_layers"], settings["layers"]) == ("none", None, "unroll"), settings
    # What auto compiled ([policy, remat_layers, depth]) and whether a compilation cache served compile_s.
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    assert raw["extra"]["remat_compiles"] == [["none", None, layers]]
    assert raw["extra"]["compilation_cache_dir"] == os.environ.get("JAX_COMPILATION_CACHE_DIR")


def test_dpo_rows_of_jaxft_and_trl_start_from_ln2_on_the_same_pairs(tiny_model_dir):
    """tiny_dpo in-process through both DPO paths: jaxft_dpo (examples/bench/dpo.yaml through Run) and trl_dpo
    (TRL's DPOTrainer.train(), timed per step by its callback). Both train the data's pairs (TRL's hash is of the
    batches its own dataloader collates), start at ln 2 (LoRA B = 0: the policy is the reference) and agree on
    step 0's log-probabilities of the chosen and rejected completions (same tokens, same completion masks)."""
    import math

    from scripts.bench import jaxft_worker, torch_worker
    from scripts.bench.worker_common import SystemUnavailable
    from scripts.bench.workloads import make_token_data, param_counts

    w = get_workload("tiny_dpo")
    with frozen_heap():
        ours = jaxft_worker.run_jaxft(w, tiny_model_dir, 2, mode="dpo")
        trl = torch_worker.run_dpo(Task("train", "trl_dpo", w.name, tiny_model_dir, 2, "cpu"))
    assert ours["data_sha256"] == trl["data_sha256"] == make_token_data(w, 2).sha256
    for raw in (ours, trl):
        assert len(raw["step_times_s"]) == len(raw["losses"]) == 2 and min(raw["step_times_s"]) > 0
        assert abs(raw["losses"][0] - math.log(2)) < 1e-6, raw["losses"]
        assert raw["trainable_params"] == param_counts(w.shape)["lora"]
    for key in ("logps/chosen", "logps/rejected"):
        got, want = ours["extra"]["objective_metrics"][0][key], trl["extra"]["objective_metrics"][0][key]
        assert abs(got - want) < 1e-5 * abs(want), (key, got, want)
    assert ours["settings"]["objective"] == {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}
    settings = trl["settings"]
    assert (settings["beta"], settings["loss_type"], settings["max_length"]) == (0.1, ["sigmoid"], w.seq_len)
    assert settings["reference"] == "the model with its adapter disabled" and settings["gradient_checkpointing"]
    # Unsloth's recipe needs CUDA: a not_run row saying so, before anything is loaded.
    with pytest.raises(SystemUnavailable, match="CUDA GPU"):
        torch_worker.run_task(Task("train", "unsloth_dpo", w.name, tiny_model_dir, 2, "cpu"), "", None)


def test_jax_task_peak_uses_the_allocator_only_when_the_steps_raised_it():
    from scripts.bench.jaxft_worker import _task_peak

    analysis = {"temp_size_in_bytes": 50, "output_size_in_bytes": 30, "alias_size_in_bytes": 20}
    before = {"bytes_in_use": 100, "peak_bytes_in_use": 500}
    assert _task_peak(before, {"peak_bytes_in_use": 700}, analysis)[:2] == (700, "allocator")
    # An earlier task (or the load) set the process peak: fall back to in-use + temp + output - alias.
    assert _task_peak(before, {"peak_bytes_in_use": 500}, analysis)[:2] == (100 + 50 + 30 - 20, "static_estimate")
    # The allocator's regions and limit are recorded beside (the step's temp is one buffer that must fit there).
    numbers = _task_peak({**before, "pool_bytes": 400, "bytes_limit": 900}, {"peak_bytes_in_use": 700}, analysis)[2]
    assert (numbers["pool_bytes_before_steps"], numbers["bytes_limit"]) == (400, 900)


def test_markdown_marks_static_memory_estimates():
    w = get_workload("tiny_llama")
    raw = {"status": "ok", "step_times_s": [1.0, 1.0], "losses": [6.0, 5.9], "peak_memory_bytes": 2 * 1024 ** 3,
           "peak_memory_source": "static_estimate", "data_sha256": "x"}
    run = {"system": "jaxft", "workload": w.name, "session": "jaxft__tiny-llama",
           "summary": summarise_run(raw, w, 1, [1.0, 1.0], "x", 1, None), "raw": raw}
    not_run = {"status": "not_run", "error": "SystemUnavailable: Unsloth needs a CUDA GPU"}
    skipped = {"system": "unsloth", "workload": w.name, "session": "unsloth", "raw": not_run,
               "summary": summarise_run(not_run, w, 1, [1.0, 1.0], "x", 1, None)}
    report = {"meta": {"date": "d", "commit": "c", "device_name": "cpu", "command": "x", "steps": 2, "warmup": 1,
                       "lora": {"r": 1, "alpha": 1, "dropout": 0, "targets": ["q_proj"]},
                       "adamw": {"lr": 1, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0}},
              "ceiling": {}, "workloads": {}, "runs": [run, skipped]}
    text = markdown(report)
    assert "| 2.00* |" in text and "* static estimate" in text
    assert "| tiny_llama | unsloth | not_run" in text  # reported, not a crash
    run["summary"]["peak_memory_source"] = "allocator"
    assert "| 2.00 |" in markdown(report) and "static estimate" not in markdown(report)


def test_the_report_checks_auto_against_the_fastest_policy_that_fits():
    """issue #10's bar: auto within 5% of the fastest jaxft policy that fits its budget (the recipe's
    max_memory_gb, or every policy that ran); a 4-bit base is another model, not a candidate."""
    from scripts.bench.report import auto_check

    w = get_workload("tiny_llama")

    def run(system, step_s, peak_gib, **settings):
        raw = {"status": "ok", "step_times_s": [step_s] * 3, "losses": [6.0, 5.9, 5.8],
               "peak_memory_bytes": int(peak_gib * 1024 ** 3), "data_sha256": "x", "settings": settings}
        return {"system": system, "workload": w.name, "summary": summarise_run(raw, w, 1, [1.0] * 3, "x", 1, None),
                "raw": raw}

    runs = [run("jaxft", 1.0, 30), run("jaxft_lean", 1.5, 10), run("jaxft_offload_attn", 1.2, 20),
            run("jaxft_qlora", 0.5, 5), run("jaxft_auto", 1.02, 30, remat="none", remat_layers=None),
            run("jaxft_auto_40gb", 1.3, 19, remat="offload+attn", max_memory_gb=25.0, remat_layers=None),
            run("unsloth", 0.1, 1)]
    by = {c["system"]: c for c in auto_check(runs)}
    assert by["jaxft_auto"]["best_system"] == "jaxft" and by["jaxft_auto"]["within"]  # 1.0 / 1.02 = 0.98
    assert by["jaxft_auto"]["ratio"] == pytest.approx(1 / 1.02)
    tight = by["jaxft_auto_40gb"]  # jaxft (30 GiB) does not fit 25 GiB: offload+attn (20 GiB) is the bar
    assert tight["best_system"] == "jaxft_offload_attn" and tight["within"] is False
    assert tight["ratio"] == pytest.approx(1.2 / 1.3)
    report = {"meta": {"date": "d", "commit": "c", "device_name": "cpu", "command": "x", "steps": 3, "warmup": 1,
                       "lora": {"r": 1, "alpha": 1, "dropout": 0, "targets": ["q_proj"]},
                       "adamw": {"lr": 1, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0}},
              "ceiling": {}, "workloads": {}, "runs": runs}
    text = markdown(report)
    assert "## remat auto against the fastest policy that fits its budget (bar: within 5%)" in text
    assert "| tiny_llama | jaxft_auto_40gb | 25.0 | offload+attn | " in text and "| 0.923 | NO |" in text
    assert auto_check([run("jaxft_auto", 1.0, 30, remat="full", remat_layers=None)])[0]["within"] is None


FAKE_WORKER = """
import os, sys, time
from scripts.bench.worker_common import worker_main

def run(task, out_json, cache):  # a real worker contract; the model_dir's name picks the behaviour
    name = os.path.basename(task.model_dir)
    t0 = time.time()
    if name == "hang":
        time.sleep(120)
    if name == "crash":
        os._exit(3)
    if name.startswith("sleep"):
        time.sleep(2.0)
    return {{"model_dir": task.model_dir, "t0": t0, "t1": time.time(),
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}}

sys.exit(worker_main(run))
"""


def _fake_worker(tmp_path):
    """FAKE_WORKER as the module `fake_worker` in tmp_path, and the environment that finds it and the repository."""
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER.format())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    return "fake_worker", lambda run_dir: env


def test_session_runner_restarts_after_the_task_a_session_died_in(tmp_path):
    from scripts.bench.sessions import SessionRunner

    module, env_for = _fake_worker(tmp_path)
    names = ["a", "hang", "c", "crash", "e"]
    tasks = [Task("save_model", "", "tiny_llama", str(tmp_path / n), 1, "cpu") for n in names]
    got = []

    def on_result(task, raw):
        got.append((os.path.basename(task.model_dir), raw["status"], raw["session"]))

    runner = SessionRunner(str(tmp_path / "work"), task_timeout_s=3.0, time_left=lambda: 600.0, min_start_s=1.0,
                           logs_dir=str(tmp_path / "logs"))
    runner.run("s", module, tasks, env_for, on_result)
    # The hung task is killed after the tiny timeout and the crash costs only its own task.
    assert got == [("a", "ok", "s"), ("hang", "timeout", "s"), ("c", "ok", "s.1"), ("crash", "crashed", "s.1"),
                   ("e", "ok", "s.2")]
    assert sorted(os.listdir(tmp_path / "logs")) == ["s", "s.1", "s.2"]
    # No time left: nothing starts, every task is recorded as skipped.
    got.clear()
    SessionRunner(str(tmp_path / "work2"), 3.0, lambda: 0.0, 1.0).run("t", module, tasks[:2], env_for, on_result)
    assert got == [("a", "skipped", None), ("hang", "skipped", None)]


def test_run_order_puts_each_shapes_workloads_in_ascending_memory():
    from scripts.bench.harness import run_order

    assert run_order(["8b_16384", "1b_2x4096", "8b_packed_16384", "qwen3_8b_4096", "8b_4096"]) == \
        ["8b_4096", "8b_packed_16384", "8b_16384", "1b_2x4096", "qwen3_8b_4096"]


def test_run_jobs_runs_sessions_concurrently_one_per_gpu(tmp_path):
    """(a) each session's worker sees only its GPU, (b) sessions overlap in time, (c) a dead session
    is continued on its GPU, and a queued one starts only when a GPU is free."""
    from scripts.bench.sessions import Job, SessionRunner, run_jobs

    module, env_for = _fake_worker(tmp_path)
    got: dict[tuple[str, str], dict] = {}

    def job(name, *dirs):
        tasks = [Task("save_model", "", "tiny_llama", str(tmp_path / d), 1, "cpu") for d in dirs]
        return Job(name, module, tasks, env_for,
                   lambda task, raw: got.setdefault((name, os.path.basename(task.model_dir)), raw))

    jobs = [job("j0", "sleep_a", "crash", "fast_c"), job("j1", "sleep_b"), job("j2", "sleep_c"),
            job("j3", "fast_d")]
    runner = SessionRunner(str(tmp_path / "work"), task_timeout_s=60.0, time_left=lambda: 600.0, min_start_s=1.0)
    run_jobs(runner, jobs, gpus=[4, 1, 7])  # nvidia-smi indices, not positions
    assert {k: (r["status"], r["session"], r["gpu"]) for k, r in got.items()} == {
        ("j0", "sleep_a"): ("ok", "j0", 4), ("j0", "crash"): ("crashed", "j0", 4),
        ("j0", "fast_c"): ("ok", "j0.1", 4),  # the continuation stays on its GPU
        ("j1", "sleep_b"): ("ok", "j1", 1), ("j2", "sleep_c"): ("ok", "j2", 7),
        ("j3", "fast_d"): ("ok", "j3", got["j3", "fast_d"]["gpu"])}
    for raw in got.values():
        if raw["status"] == "ok":
            assert raw["cuda_visible_devices"] == str(raw["gpu"])
    sleeps = [got[k] for k in (("j0", "sleep_a"), ("j1", "sleep_b"), ("j2", "sleep_c"))]
    assert max(r["t0"] for r in sleeps) < min(r["t1"] for r in sleeps)  # all three ran at once
    # j3 waited for a free GPU: it started after one of the first sessions finished its task.
    assert got["j3", "fast_d"]["t0"] > min(r["t1"] for r in sleeps)
    # No budget left: nothing starts, every task is skipped and ran on no GPU.
    got.clear()
    run_jobs(SessionRunner(str(tmp_path / "work2"), 60.0, lambda: 0.0, 1.0), jobs[1:3], gpus=[0, 1])
    assert {k: (r["status"], r["gpu"]) for k, r in got.items()} == {
        ("j1", "sleep_b"): ("skipped", None), ("j2", "sleep_c"): ("skipped", None)}


def test_cli_gpus_flag_checks_the_gpu_count(tmp_path, monkeypatch, capsys):
    from scripts.bench.train import main  # in-process: the check stops in parse_args

    monkeypatch.setenv("BENCH_FAKE_GPUS", "2")
    with pytest.raises(SystemExit) as e:
        main(["--tiny", "--gpus", "3", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert e.value.code != 0 and "--gpus 3: nvidia-smi lists 2 GPU(s)" in err
    assert "0: fake GPU 0" in err
