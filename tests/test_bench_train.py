"""Tests of the training benchmark harness (scripts/bench_train.py and scripts/bench/).

Oracles: transformers/peft themselves (parameter counts of the real shapes on the meta device,
LoRA parameter counts, the padding-free packed forward against one forward per document, the HF
loss against our targets/loss_mask), brute-force counts, and the CLI run end to end on CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")
if SCRIPTS not in sys.path:  # the bench package lives beside the scripts, not in jaxft
    sys.path.insert(0, SCRIPTS)

from bench.report import markdown, summarise_run  # noqa: E402
from bench.workloads import (LORA, SHAPES, get_workload, make_token_data,  # noqa: E402
                             param_counts, useful_flops)
from bench.worker_common import Task, dump_session, validate_train_result, worker_main  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------
# Token data.
# ------------------------------------------------------------------------------------------------


def test_token_data_is_deterministic_and_self_consistent():
    w = get_workload("tiny_packed")
    a, b = make_token_data(w, 4), make_token_data(w, 4)
    assert a.sha256 == b.sha256
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.positions, b.positions)
    assert a.sha256 != make_token_data(get_workload("tiny_llama"), 4).sha256
    s, bsz, t = 4, w.batch, w.seq_len
    for arr in (a.input_ids, a.targets, a.loss_mask, a.segment_ids, a.positions):
        assert arr.shape == (s, bsz, t)
    assert a.input_ids.min() >= 0 and a.input_ids.max() < w.shape.get("vocab_size")
    for i in range(s):
        pairs = 0
        for j in range(bsz):
            seg, pos = a.segment_ids[i, j], a.positions[i, j]
            assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and np.all(seg > 0)  # no padding
            starts = np.flatnonzero(np.r_[True, np.diff(seg) != 0])
            assert np.array_equal(np.flatnonzero(pos == 0), starts)
            for k, st in enumerate(starts):  # positions count 0.. inside each document
                end = starts[k + 1] if k + 1 < len(starts) else t
                assert np.array_equal(pos[st:end], np.arange(end - st))
            # Brute-force causal within-document pairs (diagonal included).
            q, kk = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
            allowed = (kk <= q) & (seg[:, None] == seg[None, :])
            pairs += int(allowed.sum())
        assert a.attention_pairs[i] == pairs
    # Targets are the next token inside the document; the last token of a document has none.
    nxt_same_doc = np.zeros_like(a.loss_mask, dtype=bool)
    nxt_same_doc[..., :-1] = a.segment_ids[..., 1:] == a.segment_ids[..., :-1]
    assert np.array_equal(a.loss_mask == 1, nxt_same_doc)
    assert np.array_equal(a.targets[..., :-1][nxt_same_doc[..., :-1]],
                          a.input_ids[..., 1:][nxt_same_doc[..., :-1]])
    assert np.all(a.targets[a.loss_mask == 0] == 0)
    # HF labels: -100 exactly at document starts, the token id elsewhere.
    labels = a.hf_labels()
    assert np.array_equal(labels == -100, a.positions == 0)


def test_packed_doc_lengths_follow_the_requested_mean():
    w = get_workload("8b_packed_16384")
    d = make_token_data(w, 2)
    st = d.stats()
    assert st["documents"] > 80  # ~16384 / 300 per row
    assert 230 < st["mean_doc_len"] < 380, st
    # Unpacked rows: one document per row, pairs = T (T + 1) / 2 per row.
    u = make_token_data(get_workload("1b_2x4096"), 1)
    assert u.attention_pairs[0] == 2 * 4096 * 4097 // 2
    assert u.loss_mask.sum() == 2 * 4095


# ------------------------------------------------------------------------------------------------
# Shapes and FLOPs, against transformers/peft.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape_name", ["llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-8b"])
def test_real_shapes_match_transformers_parameter_counts(shape_name):
    """Count every tensor of the real-size HF model on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from bench.models import build_config

    shape = SHAPES[shape_name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(shape))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    counts = param_counts(shape)
    assert counts["frozen_matmul"] == linear  # all layer linears + lm_head
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    published = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
                 "qwen3-8b": 8_190_735_360}[shape_name]
    assert total == published
    assert model.config.tie_word_embeddings == shape.get("tie_word_embeddings")
    # What the harness reserves on /dev/shm: every bf16 tensor but the (tiny) norm scales.
    from bench_train import model_bytes

    assert 0.999 * 2 * total < model_bytes(shape) <= 2 * total


def test_lora_param_count_matches_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench.models import build_config

    for shape_name in ("tiny-llama", "tiny-qwen3"):
        shape = SHAPES[shape_name]
        model = AutoModelForCausalLM.from_config(build_config(shape))
        peft_model = get_peft_model(model, LoraConfig(
            r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout,
            target_modules=list(LORA.targets), task_type="CAUSAL_LM"))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert trainable == param_counts(shape)["lora"]


def test_useful_flops_formula():
    shape = SHAPES["llama-3.1-8b"]
    p = param_counts(shape)
    t = 4096
    pairs = t * (t + 1) // 2
    expected = t * (4 * p["frozen_matmul"] + 6 * p["lora"]) + 12 * 32 * 32 * 128 * pairs
    assert useful_flops(shape, t, pairs) == pytest.approx(expected, rel=1e-12)
    # Attention is a few percent of an 8B step at 4k, roughly the 6ND rule's matmul part.
    assert 0.02 < 12 * 32 * 32 * 128 * pairs / expected < 0.2


# ------------------------------------------------------------------------------------------------
# The HF padding-free path: packed position_ids == one forward per document.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", ["tiny_packed", "tiny_qwen3_moe_packed", "tiny_gpt_oss_packed"])
def test_hf_padding_free_packed_forward_and_loss_match_per_document(workload):
    """The torch worker's packed forward (`packed_forward_kwargs`) equals each document alone, on every family
    the benchmark packs: transformers' GPT-OSS decoder builds its masks without the position_ids, and without the
    worker's masks its packed rows attend across documents (0.84 apart in the logits)."""
    from transformers import AutoModelForCausalLM

    from bench.models import build_config
    from bench_torch_worker import hf_attention, packed_forward_kwargs

    torch.manual_seed(0)
    w = get_workload(workload)
    model = AutoModelForCausalLM.from_config(build_config(w.shape), attn_implementation=hf_attention(
        w.shape.config_dict(), "cpu")).eval()
    data = make_token_data(w, 1)
    ids = torch.from_numpy(data.input_ids[0].astype(np.int64))
    pos = torch.from_numpy(data.positions[0].astype(np.int64))
    labels = torch.from_numpy(data.hf_labels()[0])
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, use_cache=False, **packed_forward_kwargs(model, pos))
        seg = data.segment_ids[0, 0]
        assert len(np.unique(seg)) >= 3
        per_doc = [model(input_ids=ids[:, seg == s], use_cache=False).logits
                   for s in np.unique(seg)]
    torch.testing.assert_close(out.logits, torch.cat(per_doc, dim=1), rtol=1e-4, atol=1e-4)
    # HF's shifted loss on labels == mean CE over our targets where loss_mask == 1.
    logp = torch.log_softmax(out.logits.float(), -1)
    tgt = torch.from_numpy(data.targets[0].astype(np.int64))
    mask = torch.from_numpy(data.loss_mask[0])
    nll = -logp.gather(-1, tgt[..., None])[..., 0]
    torch.testing.assert_close(out.loss, (nll * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-5)


def test_mask_factory_params_see_through_an_unsloth_style_wrapper():
    """Unsloth replaces transformers' mask factories by `(*args, **kwargs)` closures around the originals (no
    functools.wraps) next to helpers of its own; the worker's filter must still find the factory's names, or its
    packed GPT-OSS call passes no arguments (the H200 run of 2026-12-04). The wrapped call then builds the same mask
    as the factory itself."""
    import inspect

    from transformers import AutoModelForCausalLM, masking_utils

    from bench.models import build_config
    from bench_torch_worker import hf_attention, mask_factory_params

    def wrap(f):
        def _find_config(args, kwargs):  # a closed-over helper with named parameters, as Unsloth's
            return kwargs.get("config")

        def return_attention_mask(*args, **kwargs):
            _find_config(args, kwargs)
            return f(*args, **kwargs)
        return return_attention_mask

    for factory in (masking_utils.create_causal_mask, masking_utils.create_sliding_window_causal_mask):
        assert mask_factory_params(wrap(factory)) == set(inspect.signature(factory).parameters) - {"args", "kwargs"}
    shape = get_workload("tiny_gpt_oss_packed").shape
    config = AutoModelForCausalLM.from_config(build_config(shape), attn_implementation=hf_attention(
        shape.config_dict(), "cpu")).config
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    embeds = torch.empty((1, 8, 1))
    wrapped = wrap(masking_utils.create_causal_mask)
    args = {"config": config, "inputs_embeds": embeds, "attention_mask": None, "position_ids": pos, "cache": None,
            "cache_position": torch.arange(8)}
    accepted = mask_factory_params(wrapped)
    mask = wrapped(**{k: v for k, v in args.items() if k in accepted})
    allowed = mask if mask.dtype == torch.bool else mask == 0  # eager builds an additive float mask
    assert allowed.shape[-2:] == (8, 8) and bool(allowed[..., 4, 3]) and not bool(allowed[..., 3, 2])  # per document
    assert torch.equal(mask, masking_utils.create_causal_mask(**{k: v for k, v in args.items() if k in accepted}))
    with pytest.raises(TypeError, match="cannot find the parameters"):
        mask_factory_params(lambda *a, **k: None)


# ------------------------------------------------------------------------------------------------
# Worker contract and statistics.
# ------------------------------------------------------------------------------------------------


def _task(tmp_path, system="jaxft"):
    path = str(tmp_path / "task.json")
    Task("train", system, "tiny_llama", str(tmp_path), 3, "cpu").dump(path)
    return path


@pytest.mark.parametrize("exc,status", [
    (NotImplementedError("placeholder"), "not_run"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), "oom"),
    (ValueError("bad shape"), "error"),
])
def test_worker_main_records_every_outcome(tmp_path, exc, status):
    def run(task, out_json, cache):
        raise exc

    out = str(tmp_path / "result.json")
    assert worker_main(run, ["--task", _task(tmp_path), "--out", out]) == 0
    with open(out) as f:
        res = json.load(f)
    assert res["status"] == status and res["system"] == "jaxft"
    assert type(exc).__name__ in res["error"]


def test_worker_main_validates_train_results(tmp_path):
    out = str(tmp_path / "result.json")
    good = {"step_times_s": [1.0, 0.5, 0.5], "losses": [6.0, 5.9, 5.8], "peak_memory_bytes": 10,
            "data_sha256": "x"}
    assert worker_main(lambda t, o, c: dict(good), ["--task", _task(tmp_path), "--out", out]) == 0
    assert json.load(open(out))["status"] == "ok"
    bad = dict(good, losses=[6.0])
    worker_main(lambda t, o, c: bad, ["--task", _task(tmp_path), "--out", out])
    res = json.load(open(out))
    assert res["status"] == "error" and "losses" in res["error"]
    with pytest.raises(ValueError, match="peak_memory_bytes"):
        validate_train_result(dict(good, peak_memory_bytes=-1.5), 3)


def test_task_rejects_unknown_keys_and_workloads(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kind": "train", "system": "x", "workload": "tiny_llama",
                                "model_dir": "/m", "steps": 3, "device": "cpu", "colour": 1}))
    with pytest.raises(ValueError, match="colour"):
        Task.load(str(path))
    with pytest.raises(ValueError, match="known: 1b_2x4096"):
        Task("train", "x", "9b", "/m", 3, "cpu")


def test_summarise_run_drops_warmup_and_uses_one_ceiling():
    w = get_workload("tiny_llama")
    raw = {"status": "ok", "step_times_s": [10.0, 1.0, 3.0, 2.0], "losses": [6.1, 6.0, 5.9, 5.8],
           "peak_memory_bytes": 3 * 1024 ** 3, "data_sha256": "abc", "trainable_params": 7}
    flops = [100.0, 4.0, 4.0, 4.0]
    s = summarise_run(raw, w, 1, flops, "abc", 7, ceiling_flops_per_s=8.0)
    assert s["median_step_s"] == 2.0 and s["timed_steps"] == 3
    assert s["tokens_per_s"] == w.tokens_per_step / 2.0
    assert s["mfu"] == pytest.approx(4.0 / 2.0 / 8.0)
    assert s["peak_memory_gib"] == 3.0 and s["final_loss"] == 5.8 and s["first_loss"] == 6.1
    assert s["data_matches"] and s["lora_params_match"]
    assert not summarise_run(raw, w, 1, flops, "other", 7, 8.0)["data_matches"]
    assert summarise_run({"status": "oom", "error": "x"}, w, 1, flops, "abc", 7, 8.0) == {"status": "oom"}


def test_run_subprocess_records_timeout_crash_and_oom(tmp_path):
    import bench_train

    env = dict(os.environ)
    out = str(tmp_path / "none.json")
    res = bench_train.run_subprocess([sys.executable, "-c", "import time; time.sleep(60)"],
                                     str(tmp_path / "a"), out, 1.0, env)
    assert res["status"] == "timeout" and res["wall_s"] < 30
    res = bench_train.run_subprocess([sys.executable, "-c", "import sys; sys.exit(3)"],
                                     str(tmp_path / "b"), out, 30.0, env)
    assert res["status"] == "crashed" and "exit code 3" in res["error"]
    code = "import sys; print('RuntimeError: CUDA error: out of memory', file=sys.stderr); sys.exit(1)"
    res = bench_train.run_subprocess([sys.executable, "-c", code], str(tmp_path / "c"), out, 30.0, env)
    assert res["status"] == "oom"


def test_cli_rejects_too_few_timed_steps(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--steps", "5",
                          "--workloads", "8b_4096", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and ">= 10 timed steps" in res.stderr
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--tiny",
                          "--workloads", "8b_4096", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "not tiny" in res.stderr


# ------------------------------------------------------------------------------------------------
# End to end on CPU.
# ------------------------------------------------------------------------------------------------


def test_tiny_pipeline_end_to_end_hf_nockpt(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--tiny",
           "--systems", "hf_nockpt,unsloth", "--workloads", "tiny_llama,tiny_packed",
           "--out", str(out), "--md", str(md), "--commit", "test-commit"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["commit"] == "test-commit" and "bench_train.py --tiny" in meta["command"]
    assert meta["steps"] == 3 and meta["warmup"] == 1 and meta["date"]
    assert meta["versions"]["torch_side"]["transformers"] == transformers.__version__
    assert report["ceiling"]["torch"]["status"] == "ok" and report["ceiling"]["used_flops_per_s"] > 0
    model = report["models"]["tiny-llama"]
    assert model["status"] == "ok" and model["session"] == "save_models"
    assert not os.path.exists(model["model_dir"])  # removed at the end (no --keep-models)
    runs = {(r["system"], r["workload"]): r for r in report["runs"]}
    hf = runs["hf_nockpt", "tiny_packed"]
    s, raw = hf["summary"], hf["raw"]
    assert s["status"] == "ok", raw
    assert s["timed_steps"] == 2 and s["tokens_per_s"] > 0 and s["median_step_s"] > 0
    assert math.isfinite(s["final_loss"]) and s["loss_finite"]
    # Random weights, uniform tokens: the loss is near ln(vocab).
    assert abs(s["first_loss"] - math.log(512)) < 0.5
    assert s["data_matches"] and s["lora_params_match"] and 0 < s["mfu"]
    assert s["peak_memory_source"] == "allocator"
    assert raw["lora_param_dtype"] == "float32" and raw["settings"]["gradient_checkpointing"] is False
    assert "padding-free" in raw["settings"]["attention_masking"]
    # One process for both workloads, smaller one first; the second reuses the loaded base model.
    assert hf["session"] == runs["hf_nockpt", "tiny_llama"]["session"] == "hf_nockpt"
    assert (raw["session_index"], raw["base_model_reused"]) == (0, False)
    llama = runs["hf_nockpt", "tiny_llama"]["raw"]
    assert (llama["session_index"], llama["base_model_reused"], llama["status"]) == (1, True, "ok")
    assert runs["unsloth", "tiny_packed"]["summary"]["status"] == "not_run"  # reported, not a crash
    text = md.read_text()
    assert "| tiny_packed | hf_nockpt | ok |" in text and "useful_flops/step" in text
    assert "| tiny_packed | unsloth | not_run" in text
    assert report["workloads"]["tiny_packed"]["useful_flops_per_step"] > 0
    for session in ("save_models", "hf_nockpt", "unsloth"):
        assert (tmp_path / "bench_train_logs" / session / "stderr.log").exists()
    assert markdown(report) == text


def test_resume_keeps_finished_runs_without_rerunning(tmp_path):
    """A finished (ok/oom) run in --resume's JSON is kept as is; nothing is started for it."""
    w = get_workload("tiny_packed")
    raw = {"status": "ok", "step_times_s": [2.0, 1.0, 1.0], "losses": [6.2, 6.1, 6.0],
           "peak_memory_bytes": 1, "data_sha256": make_token_data(w, 3).sha256}
    summary = summarise_run(raw, w, 1, [1.0] * 3, raw["data_sha256"], 1, None)
    old = {"runs": [{"system": "hf_nockpt", "workload": "tiny_packed", "summary": summary, "raw": raw},
                    {"system": "hf_ckpt", "workload": "tiny_packed",
                     "summary": {"status": "oom"}, "raw": {"status": "oom"}},
                    # outside this pass's selection: kept in the table (passes accumulate), not re-run
                    {"system": "jaxft", "workload": "tiny_llama", "summary": summary, "raw": raw}],
           "ceiling": {}, "meta": {"command": "python scripts/bench_train.py --earlier-pass"}}
    prev = tmp_path / "old.json"
    prev.write_text(json.dumps(old))
    out = tmp_path / "new.json"
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--tiny", "--no-ceiling",
           "--systems", "hf_nockpt,hf_ckpt", "--workloads", "tiny_packed", "--resume", str(prev),
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    assert sorted((r["system"], r["workload"], r["summary"]["status"]) for r in report["runs"]) == \
        [("hf_ckpt", "tiny_packed", "oom"), ("hf_nockpt", "tiny_packed", "ok"), ("jaxft", "tiny_llama", "ok")]
    assert report["meta"]["resumed_commands"] == ["python scripts/bench_train.py --earlier-pass"]
    assert report["models"] == {}  # no model was saved: nothing was left to run
    assert "resumed from" in " ".join(report["notes"])


# ------------------------------------------------------------------------------------------------
# Sessions: several tasks per worker process.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from bench.models import save_random_model

    path = str(tmp_path_factory.mktemp("models") / "tiny-llama")
    save_random_model(SHAPES["tiny-llama"], path, "cpu")
    return path


def _run_session(script: str, tasks: list[Task], tmp_path) -> list[dict]:
    """Run a worker script on a session task file in its own process (CPU only); its result list."""
    task_path, out = str(tmp_path / f"{script}.tasks.json"), str(tmp_path / f"{script}.results.json")
    dump_session(tasks, task_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SCRIPTS, REPO]), JAX_PLATFORMS="cpu",
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), "--task", task_path, "--out", out],
                         capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        results = json.load(f)
    assert [r["session_index"] for r in results] == list(range(len(tasks)))
    assert [(r["system"], r["workload"]) for r in results] == [(t.system, t.workload) for t in tasks]
    return results


def test_hf_session_reuses_the_model_and_survives_a_failed_task(tiny_model_dir, tmp_path):
    import bench_torch_worker

    missing = str(tmp_path / "no_such_model")
    tasks = [Task("train", "hf_nockpt", wl, d, 3, "cpu") for wl, d in
             [("tiny_llama", tiny_model_dir), ("tiny_llama", missing), ("tiny_packed", tiny_model_dir),
              ("tiny_llama", tiny_model_dir)]]
    res = _run_session("bench_torch_worker.py", tasks, tmp_path)
    assert [r["status"] for r in res] == ["ok", "error", "ok", "ok"]
    assert "no_such_model" in res[1]["error"]
    # The failed task dropped the cached model (task 3 reloads it); task 4 reuses task 3's load.
    assert [r.get("base_model_reused") for r in res] == [False, None, False, True]
    # A reused model, unloaded after another workload's LoRA training, trains exactly like a fresh one.
    np.testing.assert_allclose(res[3]["losses"], res[0]["losses"], rtol=1e-6)
    # A one-task run (single-task file, its own model load) == the session's 3rd task.
    task_path, out = str(tmp_path / "single.json"), str(tmp_path / "single_result.json")
    tasks[2].dump(task_path)
    assert worker_main(bench_torch_worker.run_task, ["--task", task_path, "--out", out]) == 0
    single = json.load(open(out))
    assert single["status"] == "ok" and single["data_sha256"] == res[2]["data_sha256"]
    np.testing.assert_allclose(single["losses"], res[2]["losses"], rtol=1e-6)


def test_jaxft_session_matches_a_fresh_run_and_reports_its_memory(tiny_model_dir, tmp_path):
    import bench_jaxft_worker

    tasks = [Task("train", "jaxft", wl, tiny_model_dir, 3, "cpu") for wl in ("tiny_packed", "tiny_llama")]
    res = _run_session("bench_jaxft_worker.py", tasks, tmp_path)
    assert [r["status"] for r in res] == ["ok", "ok"], [r.get("error") for r in res]
    assert [r["base_model_reused"] for r in res] == [False, True]
    # The 2nd task's reused frozen weights + re-copied LoRA init == a fresh load (fresh cache).
    fresh = bench_jaxft_worker.run_jaxft(get_workload("tiny_llama"), tiny_model_dir, 3)
    np.testing.assert_allclose(res[1]["losses"], fresh["losses"], rtol=1e-6)
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
    import bench_jaxft_worker

    # remat auto resolves on CPU to "none" (the tiny model fits), and "none" unrolls the layers: the row must say
    # so, not the unresolved config's "scan" (the Gemma auto_40gb row of 3fa6ed3 said "scan" for an unrolled run).
    raw = bench_jaxft_worker.run_jaxft(get_workload("tiny_llama"), tiny_model_dir, 2, mode="auto")
    settings = raw["settings"]
    assert (settings["remat"], settings["remat_layers"], settings["layers"]) == ("none", None, "unroll"), settings
    # What auto compiled ([policy, remat_layers, depth]) and whether a compilation cache served compile_s.
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    assert raw["extra"]["remat_compiles"] == [["none", None, layers]]
    assert raw["extra"]["compilation_cache_dir"] == os.environ.get("JAX_COMPILATION_CACHE_DIR")


def test_jax_task_peak_uses_the_allocator_only_when_the_steps_raised_it():
    from bench_jaxft_worker import _task_peak

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
    report = {"meta": {"date": "d", "commit": "c", "device_name": "cpu", "command": "x", "steps": 2, "warmup": 1,
                       "lora": {"r": 1, "alpha": 1, "dropout": 0, "targets": ["q_proj"]},
                       "adamw": {"lr": 1, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0}},
              "ceiling": {}, "workloads": {}, "runs": [run]}
    text = markdown(report)
    assert "| 2.00* |" in text and "* static estimate" in text
    run["summary"]["peak_memory_source"] = "allocator"
    assert "| 2.00 |" in markdown(report) and "static estimate" not in markdown(report)


def test_the_report_checks_auto_against_the_fastest_policy_that_fits():
    """issue #10's bar: auto within 5% of the fastest jaxft policy that fits its budget (the recipe's
    max_memory_gb, or every policy that ran); a 4-bit base is another model, not a candidate."""
    from bench.report import auto_check

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
sys.path.insert(0, {scripts!r})
from bench.worker_common import worker_main

def run(task, out_json, cache):  # a real worker contract; the model_dir's name picks the behaviour
    name = os.path.basename(task.model_dir)
    t0 = time.time()
    if name == "hang":
        time.sleep(120)
    if name == "crash":
        os._exit(3)
    if name.startswith("sleep"):
        time.sleep(3.0)
    return {{"model_dir": task.model_dir, "t0": t0, "t1": time.time(),
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}}

sys.exit(worker_main(run))
"""


def test_session_runner_restarts_after_the_task_a_session_died_in(tmp_path):
    from bench.sessions import SessionRunner

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(scripts=SCRIPTS))
    names = ["a", "hang", "c", "crash", "e"]
    tasks = [Task("save_model", "", "tiny_llama", str(tmp_path / n), 1, "cpu") for n in names]
    got = []

    def on_result(task, raw):
        got.append((os.path.basename(task.model_dir), raw["status"], raw["session"]))

    runner = SessionRunner(str(tmp_path / "work"), task_timeout_s=6.0, time_left=lambda: 600.0, min_start_s=1.0,
                           logs_dir=str(tmp_path / "logs"))
    runner.run("s", str(script), tasks, lambda run_dir: dict(os.environ), on_result)
    # The hung task is killed after the tiny timeout and the crash costs only its own task.
    assert got == [("a", "ok", "s"), ("hang", "timeout", "s"), ("c", "ok", "s.1"), ("crash", "crashed", "s.1"),
                   ("e", "ok", "s.2")]
    assert sorted(os.listdir(tmp_path / "logs")) == ["s", "s.1", "s.2"]
    # No time left: nothing starts, every task is recorded as skipped.
    got.clear()
    SessionRunner(str(tmp_path / "work2"), 6.0, lambda: 0.0, 1.0).run("t", str(script), tasks[:2],
                                                                       lambda d: dict(os.environ), on_result)
    assert got == [("a", "skipped", None), ("hang", "skipped", None)]


def test_run_order_puts_each_shapes_workloads_in_ascending_memory():
    from bench_train import run_order

    assert run_order(["8b_16384", "1b_2x4096", "8b_packed_16384", "qwen3_8b_4096", "8b_4096"]) == \
        ["8b_4096", "8b_packed_16384", "8b_16384", "1b_2x4096", "qwen3_8b_4096"]


def test_run_jobs_runs_sessions_concurrently_one_per_gpu(tmp_path):
    """(a) each session's worker sees only its GPU, (b) sessions overlap in time, (c) a dead session
    is continued on its GPU, and a queued one starts only when a GPU is free."""
    from bench.sessions import Job, SessionRunner, run_jobs

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(scripts=SCRIPTS))
    got: dict[tuple[str, str], dict] = {}

    def job(name, *dirs):
        tasks = [Task("save_model", "", "tiny_llama", str(tmp_path / d), 1, "cpu") for d in dirs]
        return Job(name, str(script), tasks, lambda run_dir: dict(os.environ),
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


def test_cli_gpus_flag_checks_the_gpu_count(tmp_path):
    env = dict(os.environ, BENCH_FAKE_GPUS="2")
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--tiny", "--gpus", "3",
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode != 0 and "--gpus 3: nvidia-smi lists 2 GPU(s)" in res.stderr
    assert "0: fake GPU 0" in res.stderr


def test_tiny_pipeline_on_two_fake_gpus_records_each_runs_gpu(tmp_path):
    """The CLI with --gpus all on a host that lists 2 (fake) GPUs: both systems' sessions run at
    once, one per GPU, and the report says so."""
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--tiny", "--no-ceiling", "--gpus", "all",
           "--systems", "hf_nockpt,unsloth", "--workloads", "tiny_packed", "--out", str(out), "--md", str(md)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=dict(os.environ, BENCH_FAKE_GPUS="2"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["concurrent_gpus"] == 2
    assert report["meta"]["gpus"] == ["0: fake GPU 0 (BENCH_FAKE_GPUS)", "1: fake GPU 1 (BENCH_FAKE_GPUS)"]
    assert any("concurrently, each on its own GPU of one host" in n and "fake GPU 1" in n
               for n in report["notes"])
    # Queue order: hf_nockpt's session on GPU 0, unsloth's on GPU 1 (both free at the start).
    runs = {r["system"]: r for r in report["runs"]}
    assert (runs["hf_nockpt"]["summary"]["status"], runs["hf_nockpt"]["gpu"]) == ("ok", 0)
    assert (runs["unsloth"]["summary"]["status"], runs["unsloth"]["gpu"]) == ("not_run", 1)
    assert report["models"]["tiny-llama"]["gpu"] == 0  # the model save ran before, on the first GPU
    text = md.read_text()
    assert "| loss first -> last | gpu |" in text and "| tiny_packed | unsloth | not_run" in text
    row = next(line for line in text.splitlines() if line.startswith("| tiny_packed | hf_nockpt | ok |"))
    assert row.endswith("| 0 |")
    assert markdown(report) == text


# ------------------------------------------------------------------------------------------------
# Mixture-of-experts shapes: parameter counts, active-expert FLOPs, the same LoRA in every system.
# ------------------------------------------------------------------------------------------------


def _meta_model(shape):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from bench.models import build_config

    auto = AutoModelForImageTextToText if shape.is_vlm else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(build_config(shape))


@pytest.mark.parametrize("shape_name, published", [("qwen3-30b-a3b", 30_532_122_624),
                                                    ("gpt-oss-20b", 20_914_757_184)])
def test_moe_shapes_count_every_expert_stored_and_the_top_k_active(shape_name, published):
    """transformers' model on the meta device: stored = attention/lm_head Linears + every expert + routers; active =
    stored less the (E - k) experts a token skips in each sparse layer."""
    from bench.workloads import moe_layout

    shape = SHAPES[shape_name]
    model = _meta_model(shape)
    assert sum(p.numel() for p in model.parameters()) == published
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and not n.endswith("_bias"))
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", "router.weight")))
    counts, moe = param_counts(shape), moe_layout(shape)
    assert counts["stored_matmul"] == linear + experts + routers
    per_expert = experts // (sum(moe.sparse) * moe.num_experts)
    skipped = sum(moe.sparse) * (moe.num_experts - moe.top_k) * per_expert
    assert counts["frozen_matmul"] == counts["stored_matmul"] - skipped
    from bench_train import model_bytes

    assert 0.999 * 2 * published < model_bytes(shape) <= 2 * published


def test_qwen3_30b_a3b_config_is_the_released_one():
    """The fields of Qwen/Qwen3-30B-A3B's config.json as transformers' Qwen3MoeConfig reads them (its defaults differ:
    24 layers, rope_theta 1e4, norm_topk_prob false, head_dim hidden / heads = 64)."""
    from bench.models import build_config

    cfg = build_config(SHAPES["qwen3-30b-a3b"])
    assert type(cfg).__name__ == "Qwen3MoeConfig"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) == \
        (48, 2048, 128, 8, 768, 32, 4, 128, 151936, True, 1, [])
    assert cfg.rope_parameters["rope_theta"] == 1e6 and not cfg.tie_word_embeddings


def test_useful_flops_counts_the_active_experts():
    """Per token: attention + router + top-8 experts of width 768 (moe_intermediate_size, not the dense
    intermediate_size 6144) + lm_head; LoRA: attention + the top-8 experts' factors."""
    shape = SHAPES["qwen3-30b-a3b"]
    h, e, k, i, r = 2048, 128, 8, 768, LORA.r
    attn = h * 32 * 128 * 2 + h * 4 * 128 * 2
    active = 48 * (attn + h * e + k * 3 * h * i) + h * 151936
    attn_lora = r * ((h + 4096) * 2 + (h + 512) * 2)
    expert_lora = r * (h + 2 * i) + r * (i + h)
    counts = param_counts(shape)
    assert counts["frozen_matmul"] == active
    assert counts["lora_active"] == 48 * (attn_lora + k * expert_lora)
    assert counts["lora"] == 48 * (attn_lora + e * expert_lora)
    t = 4096
    pairs = t * (t + 1) // 2
    expected = t * (4 * active + 6 * 48 * (attn_lora + k * expert_lora)) + 12 * 48 * 32 * 128 * pairs
    assert useful_flops(shape, t, pairs) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("workload", ["tiny_qwen3_moe", "tiny_gpt_oss"])
def test_moe_lora_targets_are_the_same_in_jaxft_peft_and_the_count(workload, tmp_path):
    """jaxft's recipe (with the worker's overrides) and the HF worker's PEFT config adapt the same modules and expert
    parameters, at rank r everywhere; their trainable count is param_counts' "lora"."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import bench_jaxft_worker
    from bench.models import build_config, save_random_model
    from bench_torch_worker import hf_lora_targets
    from jaxft.run import Run

    w = get_workload(workload)
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    run = Run.from_config(bench_jaxft_worker.mode_config("fast", model_dir, w, "float32"), 1)
    ours = set(run.check_targets())
    peft_model = get_peft_model(AutoModelForCausalLM.from_config(build_config(w.shape)), LoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, task_type="CAUSAL_LM", **hf_lora_targets(w)))
    theirs = set(peft_model.base_model.targeted_module_names) | {
        n for n in peft_model.base_model.targeted_parameter_names}
    assert {n.removeprefix("model.") for n in ours} == {n.removeprefix("model.") for n in theirs}
    assert any("experts" in n for n in ours) and not any(n.endswith((".gate_proj", ".up_proj")) for n in ours)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == param_counts(w.shape)["lora"]
    ranks = {tuple(p.shape) for n, p in peft_model.named_parameters() if "experts" in n and "lora_A" in n}
    experts = w.shape.get("num_experts") if w.shape.has("num_experts") else w.shape.get("num_local_experts")
    assert {s[0] for s in ranks} == {LORA.r * experts}  # rank r on gate_up as on down (no 2r fusion)


def test_unsloth_peft_kwargs_train_the_same_parameters():
    """Built without running Unsloth (it needs a GPU): the MoE experts through target_parameters, attention linears
    only as modules; a VLM's language layers only; dense shapes as before."""
    from bench_torch_worker import unsloth_peft_kwargs

    moe = unsloth_peft_kwargs(get_workload("qwen3_30b_a3b_4096"))
    assert moe["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert moe["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert moe["r"] == LORA.r and moe["lora_alpha"] == LORA.alpha and moe["max_seq_length"] == 4096
    vlm = unsloth_peft_kwargs(get_workload("qwen2_5_vl_7b_448"))
    assert (vlm["finetune_vision_layers"], vlm["finetune_language_layers"], vlm["finetune_attention_modules"],
            vlm["finetune_mlp_modules"]) == (False, True, True, True)
    assert "target_modules" not in vlm and "target_parameters" not in vlm
    dense = unsloth_peft_kwargs(get_workload("8b_4096"))
    assert dense["target_modules"] == list(LORA.targets) and "target_parameters" not in dense


# ------------------------------------------------------------------------------------------------
# Vision-language shapes: the tower's counts, image rows, the same pixels and LoRA everywhere.
# ------------------------------------------------------------------------------------------------


def test_qwen2_5_vl_7b_shape_matches_transformers():
    from bench.models import build_config
    from bench.workloads import vision_params

    shape = SHAPES["qwen2.5-vl-7b"]
    cfg = build_config(shape)
    text, vision = cfg.text_config, cfg.vision_config
    assert type(cfg).__name__ == "Qwen2_5_VLConfig"
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.vocab_size, text.rope_parameters["mrope_section"]) == \
        (3584, 18944, 28, 28, 4, 152064, [16, 24, 24])
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.out_hidden_size,
            vision.window_size, list(vision.fullatt_block_indexes), vision.patch_size, vision.spatial_merge_size,
            vision.temporal_patch_size) == (32, 1280, 3420, 16, 3584, 112, [7, 15, 23, 31], 14, 2, 2)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (151655, 151652, 151653)
    model = _meta_model(shape)
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656
    named = dict(model.named_modules())
    lang = sum(m.weight.numel() for n, m in named.items() if isinstance(m, torch.nn.Linear) and "visual" not in n)
    assert param_counts(shape)["frozen_matmul"] == lang
    blocks = sum(m.weight.numel() for n, m in named.items() if isinstance(m, torch.nn.Linear) and ".blocks." in n)
    merger = sum(m.weight.numel() for n, m in named.items() if isinstance(m, torch.nn.Linear) and ".merger." in n)
    v = vision_params(shape)
    assert v["per_patch"] == named["model.visual.patch_embed.proj"].weight.numel() + blocks
    assert v["per_merged"] == merger


def test_vision_attention_pairs_follow_transformers_windows():
    """Window pairs against transformers' own window cut (get_vision_window_index's cumulative window lengths)."""
    from transformers.vision_utils import get_vision_window_index

    from bench.workloads import vision_attention_pairs

    for name, grid in (("tiny-qwen2.5-vl", (1, 10, 10)), ("tiny-qwen2.5-vl", (1, 8, 12)),
                       ("qwen2.5-vl-7b", (1, 32, 32)), ("qwen2.5-vl-7b", (1, 74, 74))):
        v = SHAPES[name].get("vision_config")
        _, cu = get_vision_window_index(torch.tensor([grid]), spatial_merge_size=2, window_size=v["window_size"],
                                        patch_size=14)
        lengths = torch.diff(torch.unique_consecutive(torch.as_tensor(cu)))
        got = vision_attention_pairs(SHAPES[name], grid)
        assert got["window"] == int((lengths ** 2).sum()) and got["full"] == (grid[1] * grid[2]) ** 2


def test_image_rows_hold_the_processors_pixels_and_mask_image_targets(tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor

    from bench.models import save_processor_config
    from bench.workloads import IMAGE_TEXT_PREFIX, synthetic_image

    w = get_workload("tiny_qwen2_5_vl")
    d = make_token_data(w, 2)
    assert d.sha256 == make_token_data(w, 2).sha256
    image_id, start = w.shape.get("image_token_id"), w.shape.get("vision_start_token_id")
    grid = d.image_grids(0)[0]
    n = grid[0] * grid[1] * grid[2] // 4  # tokens = patches / merge^2
    row = d.input_ids[0, 0]
    assert grid == (1, 10, 10) and row[IMAGE_TEXT_PREFIX] == start
    assert np.flatnonzero(row == image_id).tolist() == list(range(IMAGE_TEXT_PREFIX + 1, IMAGE_TEXT_PREFIX + 1 + n))
    assert row[IMAGE_TEXT_PREFIX + 1 + n] == w.shape.get("vision_end_token_id")
    text = np.delete(row, range(IMAGE_TEXT_PREFIX, IMAGE_TEXT_PREFIX + n + 2))
    assert (text < 508).all()  # no vision special id drawn into the text
    # A target that is an image token carries no loss; in HF's labels those positions are -100.
    assert np.array_equal(d.loss_mask[..., :-1] == 0, d.input_ids[..., 1:] == image_id)
    assert np.array_equal(d.hf_labels() == -100, (d.input_ids == image_id) | (d.positions == 0))
    # The pixels are what the image processor the model directory names gives for the seeded image.
    save_processor_config(w.shape, str(tmp_path))
    proc = AutoImageProcessor.from_pretrained(str(tmp_path))
    rng = np.random.Generator(np.random.PCG64(w.seed + 1))
    out = proc(images=[Image.fromarray(synthetic_image(rng, w.image_size))], return_tensors="np")
    pixels, grids = d.hf_images(0)
    np.testing.assert_array_equal(pixels, out["pixel_values"])
    np.testing.assert_array_equal(grids, out["image_grid_thw"])
    assert d.step(1)["pixel_values"].shape == (1, 100 * 1176) and d.step(1)["image_grid_thw"].tolist() == [[1, 10, 10]]
    # The data hash covers the pixels: other pixels, other hash.
    import dataclasses

    other = dataclasses.replace(d, pixel_values=d.pixel_values + 1.0)
    assert other.sha256 != d.sha256


def test_vlm_useful_flops_add_the_tower_forward():
    from bench.workloads import vision_attention_pairs, vision_params

    shape = SHAPES["qwen2.5-vl-7b"]
    grid = (1, 32, 32)  # 448 px
    text = useful_flops(shape, 4096, 4096 * 4097 // 2)
    vp, pairs = vision_params(shape), vision_attention_pairs(shape, grid)
    tower = 2 * (vp["per_patch"] * 1024 + vp["per_merged"] * 256) + 4 * 80 * 16 * (4 * pairs["full"]
                                                                                   + 28 * pairs["window"])
    assert useful_flops(shape, 4096, 4096 * 4097 // 2, image_grids=[grid]) == pytest.approx(text + tower, rel=1e-12)


def test_vlm_lora_targets_are_the_language_layers_in_jaxft_and_peft(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    import bench_jaxft_worker
    from bench.models import build_config, save_random_model
    from bench_torch_worker import hf_lora_targets
    from jaxft.run import Run

    w = get_workload("tiny_qwen2_5_vl")
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    assert (tmp_path / "m" / "preprocessor_config.json").exists()
    ours = Run.from_config(bench_jaxft_worker.mode_config("fast", model_dir, w, "float32"), 1).check_targets()
    peft_model = get_peft_model(AutoModelForImageTextToText.from_config(build_config(w.shape)), LoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, task_type="CAUSAL_LM", **hf_lora_targets(w)))
    theirs = peft_model.base_model.targeted_module_names
    assert sorted(ours) == sorted(theirs) and len(theirs) == 2 * 7
    assert not any("visual" in n for n in theirs)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == param_counts(w.shape)["lora"]


@pytest.mark.slow  # ~2 min on 2 cores: two jaxft sessions (compiles) and one HF session
def test_tiny_pipeline_moe_and_vlm_with_jaxft_and_hf(tmp_path):
    """The CLI end to end on the tiny Qwen3-MoE and Qwen2.5-VL: jaxft and hf_ckpt train the same data (pixels
    included) and the same LoRA parameter count, and agree on the first loss; unsloth is not_run on the CPU."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench_train.py"), "--tiny", "--no-ceiling",
           "--systems", "jaxft,hf_ckpt,unsloth", "--workloads", "tiny_qwen3_moe,tiny_qwen2_5_vl", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {(r["system"], r["workload"]): r for r in report["runs"]}
    for wl in ("tiny_qwen3_moe", "tiny_qwen2_5_vl"):
        first = []
        for system in ("jaxft", "hf_ckpt"):
            s = runs[system, wl]["summary"]
            assert s["status"] == "ok", runs[system, wl]["raw"].get("error")
            assert s["data_matches"] and s["lora_params_match"], (system, wl)
            first.append(s["first_loss"])
        assert abs(first[0] - first[1]) < 1e-3 * first[0], (wl, first)
        assert runs["unsloth", wl]["summary"]["status"] == "not_run"
    vlm = report["workloads"]["tiny_qwen2_5_vl"]
    assert vlm["data"]["image_tokens_per_step"] == 25 and vlm["params"]["vision_per_patch"] > 0
    assert any("text + image tokens" in n for n in report["notes"])
    assert any("expert LoRA" in n for n in report["notes"])


def test_qlora_mode_trains_the_moe_shape_with_4bit_experts(tmp_path):
    """The jaxft_qlora system on the tiny Qwen3-MoE (the plumbing of its qwen3_30b_a3b_4096 run): the recipe
    loads in 4 bits with expert LoRA, the experts are stored 4-bit (their codes alone are half a byte per
    weight: more than every 4-bit linear together here) and it trains."""
    import bench_jaxft_worker
    from bench.models import save_random_model
    from bench.workloads import moe_layout

    w = get_workload("tiny_qwen3_moe")
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    config = bench_jaxft_worker.mode_config("qlora", model_dir, w, "float32")
    assert config.model.quant is not None and config.lora.target_parameters
    raw = bench_jaxft_worker.run_jaxft(w, model_dir, 2, mode="qlora")
    assert len(raw["losses"]) == 2 and all(np.isfinite(raw["losses"]))
    # The row says which grouped matmul ran: the recipe's "auto" is ragged_dot off the GPU.
    assert (raw["settings"]["grouped_matmul_setting"], raw["settings"]["grouped_matmul"]) == ("auto", "xla")
    moe = moe_layout(w.shape)
    experts = sum(moe.sparse) * moe.num_experts * 3 * w.shape.get("hidden_size") * moe.width
    mem = raw["extra"]["memory_bytes"]
    assert mem["frozen_4bit_weights"] >= experts // 2
    assert mem["frozen_weights"] < 4 * experts  # all frozen weights < the experts alone in float32


def test_moe_rows_record_the_grouped_matmul_and_jaxft_bench_gmm_chooses_it(tmp_path, monkeypatch):
    """JAXFT_BENCH_GMM sets the recipe's grouped_matmul_implementation (the A/B switch); a MoE row's settings name
    the implementation that ran, a dense row's none."""
    import bench_jaxft_worker
    from bench.models import save_random_model

    w = get_workload("tiny_qwen3_moe")
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    monkeypatch.setenv("JAXFT_BENCH_GMM", "reference")
    execution = bench_jaxft_worker.mode_config("fast", model_dir, w, "float32").execution
    assert execution.grouped_matmul_implementation == "reference"
    assert bench_jaxft_worker.grouped_matmul_settings(w, execution, "bfloat16") == {
        "grouped_matmul_setting": "reference", "grouped_matmul": "reference"}
    auto = execution.replace(grouped_matmul_implementation="auto")
    assert bench_jaxft_worker.grouped_matmul_settings(w, auto, "float32")["grouped_matmul"] == "xla"  # CPU
    assert bench_jaxft_worker.grouped_matmul_settings(get_workload("tiny_llama"), auto, "float32") == {}


def test_hf_attention_is_what_transformers_accepts_for_each_family(tmp_path):
    """SDPA unless transformers refuses it: eager for Gemma 2's soft-capping; GPT-OSS's sinks have no SDPA path,
    flex attention on a GPU and eager on the CPU (transformers refuses sinks in flex attention there). Before,
    the worker asked for SDPA and HF+PEFT could not load GPT-OSS at all (found on a tiny model, CPU)."""
    import transformers

    from bench.models import build_config
    from bench_torch_worker import hf_attention

    configs = {name: build_config(SHAPES[name]).to_dict() for name in ("tiny-gpt-oss", "tiny-gemma2", "tiny-llama")}
    assert hf_attention(configs["tiny-llama"], "cuda") == "sdpa"
    assert hf_attention(configs["tiny-gemma2"], "cuda") == hf_attention(configs["tiny-gemma2"], "cpu") == "eager"
    assert (hf_attention(configs["tiny-gpt-oss"], "cuda"), hf_attention(configs["tiny-gpt-oss"], "cpu")) == (
        "flex_attention", "eager")
    with pytest.raises(ValueError, match="does not support an attention implementation through"):
        transformers.AutoModelForCausalLM.from_config(build_config(SHAPES["tiny-gpt-oss"]), attn_implementation="sdpa")


def test_hf_vlm_steps_take_the_m_rope_positions_jaxft_computes(tmp_path):
    """The torch side's vision inputs (`TokenData.hf_vision_inputs`) make transformers compute M-RoPE positions
    equal to jaxft's `mrope_positions` for the same row (text after an image advances by max(h, w) merged
    patches, not by the image's token count), and `train_loop` refuses a VLM step that computed none: without
    mm_token_type_ids transformers 5 silently trains on 1-D positions (what the 7B rows of section 19 did)."""
    import dataclasses

    import jax.numpy as jnp
    from transformers import AutoModelForImageTextToText

    from bench.models import build_config
    from bench_torch_worker import train_loop
    from jaxft.models.vision.config import VisionConfig
    from jaxft.models.vision.mrope import mrope_positions

    w = get_workload("tiny_qwen2_5_vl")
    d = make_token_data(w, 2)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(build_config(w.shape))
    inputs = d.hf_vision_inputs(0)
    assert set(inputs) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert inputs["mm_token_type_ids"].sum() == (d.input_ids[0] == w.shape.get("image_token_id")).sum() == 25
    theirs, _ = model.model.get_rope_index(torch.from_numpy(d.input_ids[0].astype(np.int64)),
                                           mm_token_type_ids=torch.from_numpy(inputs["mm_token_type_ids"]),
                                           image_grid_thw=torch.from_numpy(inputs["image_grid_thw"]))
    cfg = VisionConfig.from_hf("qwen2_5_vl", build_config(w.shape).to_dict())
    ours = mrope_positions(jnp.asarray(d.input_ids[0]), jnp.asarray(inputs["image_grid_thw"]), cfg)
    np.testing.assert_array_equal(theirs.numpy(), np.asarray(ours))
    t = d.input_ids.shape[-1]
    assert int(theirs[0, 0, -1]) == t - 1 - 25 + 5  # 25 image tokens advance the text by 5 (a 5 x 5 merged grid)

    out = train_loop(model, w, d, 1, "cpu")
    assert np.isfinite(out["losses"][0])

    class OneDimensional(type(d)):  # what the bench passed before: no mm_token_type_ids
        def hf_vision_inputs(self, i):
            return {k: v for k, v in super().hf_vision_inputs(i).items() if k != "mm_token_type_ids"}

    with pytest.raises(RuntimeError, match=r"tiny_qwen2_5_vl: the model computed no M-RoPE positions .*"
                                           r"pass mm_token_type_ids"):
        train_loop(model, w, OneDimensional(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}), 1, "cpu")


def test_resident_outside_names_the_arrays_beside_the_state_and_the_allocator_difference():
    import jax.numpy as jnp

    import bench_jaxft_worker

    state = {"w": jnp.ones((64, 64), jnp.float32)}
    stray = jnp.zeros((128, 128), jnp.bfloat16)  # alive beside the state, as a leftover of a load would be

    class Device:  # the GPU's allocator statistics, which the CPU backend does not report
        def memory_stats(self):
            return {"bytes_in_use": 64 * 64 * 4 + stray.nbytes + 1000}

    found = bench_jaxft_worker.resident_outside(state, Device())
    assert [128, 128] in [shape for shape, _, _ in found["largest"]] and found["bytes"] >= stray.nbytes
    assert found["state_bytes"] == 64 * 64 * 4
    assert found["in_use_beyond_state"] == found["in_use_beyond_state_after_gc"] == stray.nbytes + 1000


def test_models_go_to_shm_only_when_the_host_ram_holds_them_and_the_saving_worker():
    """The two MoE shapes of the benchmark together passed /dev/shm's free-space check on the 128 GiB H200 host,
    and the save was killed for memory: /dev/shm is RAM, and the saving worker holds the model it writes."""
    from bench_train import model_bytes, models_place

    gib = 2 ** 30
    qwen, gpt_oss = model_bytes(SHAPES["qwen3-30b-a3b"]), model_bytes(SHAPES["gpt-oss-20b"])
    assert 55 * gib < qwen < 60 * gib and 37 * gib < gpt_oss < 41 * gib  # bf16, every expert stored
    host = dict(shm_free=128 * gib, ram_available=125 * gib)  # the H200 host's /dev/shm and RAM, about
    assert models_place([qwen], disk_free=60 * gib, **host) == "shm"  # it ran so
    assert models_place([gpt_oss], disk_free=60 * gib, **host) == "shm"
    assert models_place([qwen, gpt_oss], disk_free=200 * gib, **host) == "disk"
    why = models_place([qwen, gpt_oss], disk_free=60 * gib, **host)
    assert why.startswith("the models need 9") and "one TRAIN_PLAN pass per shape" in why and "\n" not in why
    assert models_place([qwen], shm_free=50 * gib, ram_available=125 * gib, disk_free=100 * gib) == "disk"
