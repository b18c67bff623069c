"""Tests of the training benchmark harness (scripts/bench/: python -m scripts.bench.train): token data, dense
shapes and FLOPs, the HF packed forward, the worker contract, the CLI end to end. Worker sessions are tested in
test_bench_sessions.py, the MoE and vision-language families in test_bench_families.py.

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

from scripts.bench.harness import FULL_SYSTEMS  # noqa: E402
from scripts.bench.report import markdown, summarise_run  # noqa: E402
from scripts.bench.workloads import (LORA, SHAPES, get_workload, make_token_data,  # noqa: E402
                             param_counts, useful_flops)
from scripts.bench.worker_common import (ModelCache, Task, run_one, validate_train_result,  # noqa: E402
                                         worker_main)

from bench_helpers import frozen_heap  # noqa: E402

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


@pytest.mark.parametrize("shape_name", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b",
                                        "qwen3-8b"])
def test_real_shapes_match_transformers_parameter_counts(shape_name):
    """Count every tensor of the real-size HF model on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from scripts.bench.models import build_config

    shape = SHAPES[shape_name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(shape))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    counts = param_counts(shape)
    assert counts["frozen_matmul"] == linear  # all layer linears + lm_head
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    published = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
                 "llama-3.1-70b": 70_553_706_496, "qwen3-8b": 8_190_735_360}[shape_name]
    assert total == published
    assert model.config.tie_word_embeddings == shape.get("tie_word_embeddings")
    # What the harness reserves on /dev/shm: every bf16 tensor but the (tiny) norm scales.
    from scripts.bench.harness import model_bytes

    assert 0.999 * 2 * total < model_bytes(shape) <= 2 * total


def test_lora_param_count_matches_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from scripts.bench.models import build_config

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
    # DPO: the reference (base model) forward over the same tokens and pairs on top.
    ref = t * 2 * p["frozen_matmul"] + 4 * 32 * 32 * 128 * pairs
    assert useful_flops(shape, t, pairs, reference_forward=True) == pytest.approx(expected + ref, rel=1e-12)
    # A full fine-tune: the weight gradients of every matmul too, no adapters.
    full = t * 6 * p["frozen_matmul"] + 12 * 32 * 32 * 128 * pairs
    assert useful_flops(shape, t, pairs, full=True) == pytest.approx(full, rel=1e-12)


def test_full_finetune_systems_are_read_from_their_recipes_and_checked_against_the_whole_model():
    assert "jaxft_full" in FULL_SYSTEMS and "unsloth_full" in FULL_SYSTEMS and "jaxft" not in FULL_SYSTEMS
    w = get_workload("tiny_llama")
    raw = {"status": "ok", "step_times_s": [1.0, 1.0], "losses": [1.0, 1.0], "peak_memory_bytes": 1,
           "trainable_params": 106816}
    assert summarise_run(raw, w, 1, [1.0, 1.0], "x", 106816, None)["lora_params_match"]
    assert not summarise_run(raw, w, 1, [1.0, 1.0], "x", 32768, None)["lora_params_match"]
    assert summarise_run(raw, w, 1, [1.0, 1.0], "x", None, None)["lora_params_match"]  # a resumed report's model


def test_dpo_pairs_are_jaxft_rows_and_trl_examples_of_the_same_tokens():
    """A DPO workload's data: each row one whole pair (prompt + chosen, prompt + rejected: two documents of seq_len,
    the same prompt, the loss mask on the completions' targets only), TRL's examples of the same tokens; the hash of
    what TRL's own collator makes of them (preference_sha256) is the data's, and differs when TRL cuts the rows
    (max_length) or pads them."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from scripts.bench.workloads import preference_sha256

    w = get_workload("tiny_dpo")
    d = make_token_data(w, 2)
    t, p = w.seq_len, d.prompt_len
    assert w.tokens_per_step == d.input_ids[0].size == 2 * w.batch * t and p == t // 2
    assert np.array_equal(d.segment_ids[0, 0], np.repeat([1, 2], t))
    one_side = np.r_[np.zeros(p - 1), np.ones(t - p), 0]  # targets p .. t-1 of a side: its completion
    assert np.array_equal(d.loss_mask[0, 0], np.r_[one_side, one_side])
    assert d.attention_pairs[0] == 2 * w.batch * t * (t + 1) // 2  # two causal rows of t per pair
    examples = [d.preference_examples(i) for i in range(2)]
    ex = examples[1][1]
    assert (len(ex["prompt_ids"]), len(ex["chosen_ids"]), len(ex["rejected_ids"])) == (p, t - p, t - p)
    assert ex["prompt_ids"] + ex["chosen_ids"] + ex["prompt_ids"] + ex["rejected_ids"] == d.input_ids[1, 1].tolist()

    def trl_hash(**collator):
        collate = DataCollatorForPreference(pad_token_id=3, **collator)
        batches = [collate(step) for step in examples]
        return preference_sha256([(b["input_ids"].numpy(), b["completion_mask"].numpy()) for b in batches])

    assert trl_hash(max_length=t) == d.sha256
    assert trl_hash(max_length=t - 1) != d.sha256  # a cut completion
    assert trl_hash(max_length=t, pad_to_multiple_of=t + 1) != d.sha256  # padding


# ------------------------------------------------------------------------------------------------
# The HF padding-free path: packed position_ids == one forward per document.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", ["tiny_packed", "tiny_qwen3_moe_packed", "tiny_gpt_oss_packed"])
def test_hf_padding_free_packed_forward_and_loss_match_per_document(workload):
    """The torch worker's packed forward (`packed_forward_kwargs`) equals each document alone, on every family
    the benchmark packs: transformers' GPT-OSS decoder builds its masks without the position_ids, and without the
    worker's masks its packed rows attend across documents (0.84 apart in the logits)."""
    from transformers import AutoModelForCausalLM

    from scripts.bench.models import build_config
    from scripts.bench.torch_worker import hf_attention, packed_forward_kwargs

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

    from scripts.bench.models import build_config
    from scripts.bench.torch_worker import hf_attention, mask_factory_params

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


OUTCOMES = [(NotImplementedError("placeholder"), "not_run"),
            (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
            (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), "oom"),
            (ValueError("bad shape"), "error")]


@frozen_heap()
def test_worker_main_records_every_outcome_and_validates_train_results(tmp_path):
    """Every outcome of a task (`run_one`, which worker_main runs for each task) is a result; worker_main writes it
    and exits 0."""
    task = Task("train", "jaxft", "tiny_llama", str(tmp_path), 3, "cpu")
    out = str(tmp_path / "result.json")
    for exc, status in OUTCOMES:
        def run(task, out_json, cache):
            raise exc

        res = run_one(run, task, out, ModelCache())
        assert res["status"] == status and res["system"] == "jaxft", exc
        assert type(exc).__name__ in res["error"]
    good = {"step_times_s": [1.0, 0.5, 0.5], "losses": [6.0, 5.9, 5.8], "peak_memory_bytes": 10,
            "data_sha256": "x"}
    assert run_one(lambda t, o, c: dict(good), task, out, ModelCache())["status"] == "ok"
    res = run_one(lambda t, o, c: dict(good, losses=[6.0]), task, out, ModelCache())
    assert res["status"] == "error" and "losses" in res["error"]
    with pytest.raises(ValueError, match="peak_memory_bytes"):
        validate_train_result(dict(good, peak_memory_bytes=-1.5), 3)

    def oom(task, out_json, cache):
        raise OUTCOMES[1][0]

    assert worker_main(oom, ["--task", _task(tmp_path), "--out", out]) == 0
    with open(out) as f:
        res = json.load(f)
    assert res["status"] == "oom" and res["system"] == "jaxft" and "RuntimeError" in res["error"]


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
    from scripts.bench.sessions import run_subprocess

    env = dict(os.environ)
    out = str(tmp_path / "none.json")
    res = run_subprocess([sys.executable, "-c", "import time; time.sleep(60)"],
                                     str(tmp_path / "a"), out, 1.0, env)
    assert res["status"] == "timeout" and res["wall_s"] < 30
    res = run_subprocess([sys.executable, "-c", "import sys; sys.exit(3)"],
                                     str(tmp_path / "b"), out, 30.0, env)
    assert res["status"] == "crashed" and "exit code 3" in res["error"]
    code = "import sys; print('RuntimeError: CUDA error: out of memory', file=sys.stderr); sys.exit(1)"
    res = run_subprocess([sys.executable, "-c", code], str(tmp_path / "c"), out, 30.0, env)
    assert res["status"] == "oom"


def test_cli_rejects_too_few_timed_steps(tmp_path, capsys):
    """The CLI's argument errors (in-process: they stop in parse_args, before anything runs)."""
    from scripts.bench.train import main

    for argv, message in ((["--steps", "5", "--workloads", "8b_4096"], ">= 10 timed steps"),
                          (["--tiny", "--workloads", "8b_4096"], "not tiny"),
                          (["--tiny", "--systems", "jaxft_dpo,hf_ckpt", "--workloads", "tiny_dpo"],
                           "hf_ckpt x tiny_dpo: the DPO systems"),
                          (["--tiny", "--systems", "trl_dpo", "--workloads", "tiny_llama"], "trl_dpo x tiny_llama")):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--out", str(tmp_path / "x.json")])
        assert e.value.code != 0 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# End to end on CPU.
# ------------------------------------------------------------------------------------------------


def test_tiny_pipeline_end_to_end_jaxft_and_hf_on_two_fake_gpus(tmp_path):
    """The CLI end to end, once for every worker kind, on the tiny packed Qwen3-MoE with --gpus all on a host that
    lists 2 (fake) GPUs: the ceiling and the model save first, then the sessions (jaxft, HF+PEFT) side by side, one
    per GPU. jaxft and hf_nockpt train the same data and the same (expert) LoRA parameter count and agree on the
    first loss. (Unsloth's not_run row on the CPU: test_bench_sessions.py, a task of the in-process torch session
    and a row of the markdown check.)"""
    wl = "tiny_qwen3_moe_packed"
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    cmd = [sys.executable, "-m", "scripts.bench.train", "--tiny", "--gpus", "all",
           "--systems", "jaxft,hf_nockpt", "--workloads", wl,
           "--out", str(out), "--md", str(md), "--commit", "test-commit"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=dict(os.environ, BENCH_FAKE_GPUS="2"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["concurrent_gpus"] == 2
    assert meta["gpus"] == ["0: fake GPU 0 (BENCH_FAKE_GPUS)", "1: fake GPU 1 (BENCH_FAKE_GPUS)"]
    assert any("concurrently, each on its own GPU of one host" in n and "fake GPU 1" in n for n in report["notes"])
    assert any("expert LoRA" in n for n in report["notes"])
    assert meta["commit"] == "test-commit" and "-m scripts.bench.train --tiny" in meta["command"]
    assert meta["steps"] == 3 and meta["warmup"] == 1 and meta["date"]
    assert meta["versions"]["torch_side"]["transformers"] == transformers.__version__
    assert report["ceiling"]["torch"]["status"] == "ok" and report["ceiling"]["used_flops_per_s"] > 0
    model = report["models"]["tiny-qwen3-moe"]
    assert model["status"] == "ok" and model["session"] == "save_models"
    assert not os.path.exists(model["model_dir"])  # removed at the end (no --keep-models)
    runs = {(r["system"], r["workload"]): r for r in report["runs"]}
    first = []
    for system in ("jaxft", "hf_nockpt"):
        s, raw = runs[system, wl]["summary"], runs[system, wl]["raw"]
        assert s["status"] == "ok", raw.get("error")
        assert s["data_matches"] and s["lora_params_match"], system
        assert s["timed_steps"] == 2 and s["tokens_per_s"] > 0 and s["median_step_s"] > 0 and 0 < s["mfu"]
        assert math.isfinite(s["final_loss"]) and s["loss_finite"]
        # Random weights, uniform tokens: the loss is near ln(vocab).
        assert abs(s["first_loss"] - math.log(512)) < 0.5
        first.append(s["first_loss"])
    assert abs(first[0] - first[1]) < 1e-3 * first[0], first
    hf = runs["hf_nockpt", wl]
    s, raw = hf["summary"], hf["raw"]
    assert s["peak_memory_source"] == "allocator"
    assert raw["lora_param_dtype"] == "float32" and raw["settings"]["gradient_checkpointing"] is False
    assert "padding-free" in raw["settings"]["attention_masking"]
    assert (raw["session_index"], raw["base_model_reused"]) == (0, False)
    # The save runs first on GPU 0; then the two sessions share the two GPUs, each on one of them.
    assert model["gpu"] == 0
    assert {runs[system, wl]["gpu"] for system in ("jaxft", "hf_nockpt")} == {0, 1}
    text = md.read_text()
    assert f"| {wl} | hf_nockpt | ok |" in text and f"| {wl} | jaxft | ok |" in text
    assert "useful_flops/step" in text and "| loss first -> last | gpu |" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {wl} | hf_nockpt | ok |"))
    assert row.endswith(f"| {hf['gpu']} |")
    assert report["workloads"][wl]["useful_flops_per_step"] > 0
    for session in ("save_models", "hf_nockpt"):
        assert (tmp_path / "bench_train_logs" / session / "stderr.log").exists()
    assert any(p.name.startswith("jaxft") for p in (tmp_path / "bench_train_logs").iterdir())
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
           "ceiling": {}, "meta": {"command": "python -m scripts.bench.train --earlier-pass"}}
    prev = tmp_path / "old.json"
    prev.write_text(json.dumps(old))
    out = tmp_path / "new.json"
    from scripts.bench.train import main  # in-process: nothing is left to start a worker for

    assert main(["--tiny", "--no-ceiling", "--systems", "hf_nockpt,hf_ckpt", "--workloads", "tiny_packed",
                 "--resume", str(prev), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted((r["system"], r["workload"], r["summary"]["status"]) for r in report["runs"]) == \
        [("hf_ckpt", "tiny_packed", "oom"), ("hf_nockpt", "tiny_packed", "ok"), ("jaxft", "tiny_llama", "ok")]
    assert report["meta"]["resumed_commands"] == ["python -m scripts.bench.train --earlier-pass"]
    assert report["models"] == {}  # no model was saved: nothing was left to run
    assert "resumed from" in " ".join(report["notes"])
