#!/usr/bin/env python
"""Torch-side worker of the training benchmark (scripts.bench.train): one process per session (a list of tasks).

The harness gives each torch system one session holding all its workloads, grouped by model
shape (see worker_common for the session contract: results rewritten after every task).

Systems:
  hf_ckpt / hf_nockpt  transformers + PEFT, attn_implementation="sdpa" (`hf_attention`: "eager" for Gemma 2's softcap,
                       "flex_attention" for GPT-OSS's sinks), bf16 weights, LoRA
                       parameters fp32 (PEFT's autocast_adapter_dtype), gradient checkpointing
                       (non-reentrant) on / off, torch.optim.AdamW(fused=True on CUDA).
                       Packed workloads use HF's padding-free path: one row of concatenated
                       documents, no attention_mask, position_ids restarting per document and
                       labels = -100 at each document start. transformers (5.17 and 5.24 read)
                       detects the restarts in masking_utils.find_packed_sequence_indices and,
                       for SDPA, materialises a block-diagonal causal bool mask [B, 1, T, T]
                       (dense attention with a mask; there is no varlen SDPA kernel). This only
                       happens without a KV cache, so use_cache=False is passed explicitly: with
                       the config default (True, and gradient checkpointing off) a DynamicCache is
                       created and the packing is silently ignored (attention crosses documents).
                       GPT-OSS's decoder builds its masks without the position_ids, so for it the worker
                       passes the masks transformers builds from them (`packed_forward_kwargs`; Unsloth too,
                       though Unsloth 2026.10.9's GPT-OSS training attention, unsloth_zoo's
                       flex_attention_with_sink, builds its own causal / sliding BlockMask and ignores
                       attention_mask while training: its packed GPT-OSS rows attend across documents, which
                       the first-loss spread shows).
  hf_qlora             hf_ckpt on a bitsandbytes 4-bit base (BitsAndBytesConfig: nf4, double quantisation,
                       bf16 compute; quantised by transformers while loading the bf16 directory):
                       HF + PEFT + bitsandbytes QLoRA as its users run it.
  unsloth              FastLanguageModel (16-bit LoRA, use_gradient_checkpointing="unsloth");
                       imported before transformers/peft, needs a CUDA GPU. Packed workloads pass
                       the same position_ids (Unsloth derives packed_seq_lengths from them).
  unsloth_4bit         the same with load_in_4bit=True (Unsloth's QLoRA: bitsandbytes nf4 base).
  unsloth_full         full fine-tuning (from_pretrained's full_finetuning=True, no adapter): the peer of
                       jaxft_full (examples/bench/full.yaml). Unsloth trains the bf16 weights themselves (no fp32
                       master copy, as jaxft keeps), so its memory is not jaxft_full's like for like.
  trl_dpo              DPO (the DPO workloads): TRL's DPOTrainer.train() on the AutoModelForCausalLM of hf_ckpt, given a
                       peft_config of the same LoRA (TRL wraps the model; its reference is the model with the adapter
                       disabled), TRL's defaults otherwise (gradient checkpointing on, the reference forward each step).
  unsloth_dpo          Unsloth's DPO recipe: FastLanguageModel.from_pretrained + get_peft_model (as unsloth) +
                       PatchDPOTrainer() + TRL's DPOTrainer (as Unsloth patched it) on that PeftModel, ref_model None
                       (TRL 1.15 then copies the initial adapter as a "ref" adapter: settings.reference says which).
                       Both get the pairs pre-tokenized (prompt_ids / chosen_ids / rejected_ids, which TRL's collator
                       reads: `pretokenized_dpo_trainer`), in order (train_sampling_strategy sequential), max_length the
                       workload's seq_len, the benchmark's AdamW and DPO beta / loss type (dpo_args). A step is timed
                       from the trainer's on_step_begin to its on_step_end, each device-synchronised (`step_clock`);
                       its loss and DPO metrics are the trainer's log of that step (logging_steps=1). The data hash is
                       computed from the batches the trainer's own dataloader collates (preference_sha256). Each task
                       loads its model afresh (TRL adds a fused LM head to the model it trains).
Mixture-of-experts shapes (Qwen3-MoE, GPT-OSS): the experts are raw [E, ., .] parameters, not Linear
modules; every system adapts the attention linears and, as expert LoRA at rank r, the experts (PEFT's
target_parameters = LORA.expert_targets, the same two jaxft's lora_target_parameters adapts; see
workloads.lora_module_targets for why gate/up/down_proj are not passed as target_modules). Unsloth runs its MoE backend
(UNSLOTH_MOE_BACKEND, default grouped_mm where torch._grouped_mm runs; the chosen one is recorded in
settings.moe_backend). Vision-language shapes (Qwen2.5-VL): HF loads Qwen2_5_VLForConditionalGeneration
(AutoModelForImageTextToText) and adapts the language model's q..down linears only (a regex on
model.language_model.layers, so the vision tower's own gate/up/down_proj stay frozen, as jaxft's
finetune_vision_layers=false); Unsloth uses FastVisionModel with finetune_vision_layers=False. Every step passes the
same pixel_values, image_grid_thw and mm_token_type_ids (TokenData.hf_vision_inputs), from which the model computes its
M-RoPE positions (without mm_token_type_ids it would use 1-D positions: see there). Also task kind "save_model": write
the random-weight model directory of a shape (the harness saves every shape in one session).

Between tasks of a session: HF systems keep the loaded bf16 base model while the model_dir stays
the same; each task wraps it with a fresh PEFT LoRA (torch.manual_seed(0) first, so the init is
the one a fresh process draws), a fresh AdamW and its own data, and unloads the LoRA layers at
the end (PeftModel.unload restores the original nn.Linear modules in place). Unsloth reloads per
task: FastLanguageModel.from_pretrained takes the workload's max_seq_length and get_peft_model
patches the model in ways it offers no undo for; the session still saves the import/patching and
Triton compile cost. Peak memory: torch.cuda.reset_peak_memory_stats() just before each task's
first step (after the previous task's state was freed), max_memory_allocated after its last.

Usage (the harness does this, from the repository root or with it on PYTHONPATH):
    python -m scripts.bench.torch_worker --task TASKS.json --out RESULTS.json
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Callable

HF_SYSTEMS = ("hf_ckpt", "hf_nockpt", "hf_qlora")
UNSLOTH_SYSTEMS = ("unsloth", "unsloth_4bit", "unsloth_full", "unsloth_dpo")
DPO_SYSTEMS = ("trl_dpo", "unsloth_dpo")  # TRL's DPOTrainer, on the DPO workloads
SYSTEMS = HF_SYSTEMS + UNSLOTH_SYSTEMS + ("trl_dpo",)
# The tokenized preference columns TRL's DataCollatorForPreference reads (TokenData.preference_examples).
PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def _peek_tasks(argv: list[str]) -> list[dict[str, Any]]:
    """Read the tasks before importing torch: Unsloth must be imported before transformers/peft."""
    path = argv[argv.index("--task") + 1] if "--task" in argv else None
    if path is None:
        return []
    with open(path) as f:
        raw = json.load(f)
    return [t for t in (raw if isinstance(raw, list) else [raw]) if isinstance(t, dict)]


_UNSLOTH_IMPORT_ERROR: BaseException | None = None
# The caller's Unsloth switches (e.g. UNSLOTH_BLOCK_COMPILE=0), read before `import unsloth` sets its own
# UNSLOTH_* variables; the harness's bookkeeping ones are left out. Recorded so a row says how Unsloth ran.
_UNSLOTH_CALLER_ENV = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UNSLOTH_")
                       and k not in ("UNSLOTH_DISABLE_STATISTICS", "UNSLOTH_COMPILE_LOCATION")}
if any(t.get("system") in UNSLOTH_SYSTEMS and t.get("device") == "cuda" for t in _peek_tasks(sys.argv)):
    try:
        import unsloth  # noqa: F401  (patches transformers/peft; must come first)
    except Exception as _e:  # reported as not_run by run_train
        _UNSLOTH_IMPORT_ERROR = _e

import numpy as np  # noqa: E402

from .workloads import (ADAMW, DPO_BETA, DPO_LOSS_TYPE, LORA, TokenData, Workload,  # noqa: E402
                        lora_module_targets, make_token_data, moe_layout, preference_sha256)
from .worker_common import ModelCache, SystemUnavailable, Task, is_oom_message, worker_main  # noqa: E402


def _versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "triton") + extra:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    import torch

    out["cuda"] = str(torch.version.cuda)
    return out


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _lora_dtype_and_count(model) -> tuple[str, int, list[str]]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in trainable})
    non_lora = [n for n, _ in trainable if "lora_" not in n]
    return ",".join(dtypes), int(sum(p.numel() for _, p in trainable)), non_lora[:5]


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_lora_targets(workload: Workload) -> dict[str, Any]:
    """PEFT LoraConfig target keys training the same parameters as jaxft's recipe for this shape (see the
    module docstring): target_modules (a regex on the language model for a VLM) and target_parameters."""
    shape = workload.shape
    targets: Any = list(lora_module_targets(shape))
    if shape.is_vlm:
        attn = "|".join(t for t in LORA.targets if t in _ATTENTION)
        mlp = "|".join(t for t in LORA.targets if t not in _ATTENTION)
        targets = rf"model\.language_model\.layers\.\d+\.(self_attn\.({attn})|mlp\.({mlp}))"
    out = {"target_modules": targets}
    if moe_layout(shape) is not None:
        out["target_parameters"] = list(LORA.expert_targets)
    return out


# Model types whose decoder builds its attention masks without the position_ids (transformers 5.24 read: GPT-OSS's
# `create_causal_mask(**mask_kwargs)` gets no position_ids), so its padding-free packed rows would attend across
# documents. For these the worker builds the masks itself, with transformers' own mask functions and the
# position_ids, and passes them as the layer-type mapping the decoder accepts in place of attention_mask.
# tests/test_bench_train.py checks packed logits against each document alone for every MoE/dense tiny shape.
MASKS_WITHOUT_POSITION_IDS = ("gpt_oss",)


def mask_factory_params(fn) -> set[str]:
    """The parameter names of a transformers mask factory, through wrappers: Unsloth 2026.10.9 replaces
    `masking_utils.create_causal_mask` (and the sliding one) by a `(*args, **kwargs)` closure around the original,
    without functools.wraps, so the wrapper's own signature names nothing and a filter on it would drop every
    argument ("create_causal_mask() missing 4 required positional arguments", its packed GPT-OSS row on the H200).
    Looks at the function, its `__wrapped__` chain, then the callables its closure holds, breadth first, for the
    first signature that names `config`."""
    import inspect

    seen, todo = set(), [fn]
    while todo:
        cand = todo.pop(0)
        if id(cand) in seen:
            continue
        seen.add(id(cand))
        try:
            params = inspect.signature(cand, follow_wrapped=False).parameters.values()
        except (TypeError, ValueError):
            params = ()
        named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if "config" in named:  # a factory, not a helper the wrapper also closes over (Unsloth's _find_config)
            return named
        todo += [w for w in [getattr(cand, "__wrapped__", None)] if w is not None]
        for cell in getattr(cand, "__closure__", None) or ():
            try:
                todo += [cell.cell_contents] if callable(cell.cell_contents) else []
            except ValueError:  # a cell not bound yet
                pass
    raise TypeError(f"cannot find the parameters of the mask factory {fn!r} (wrapped without a reachable original)")


def packed_forward_kwargs(model, pos) -> dict[str, Any]:
    """The forward kwargs of one packed row ([1, T] position_ids restarting per document): position_ids, and for
    MASKS_WITHOUT_POSITION_IDS the per-layer-type masks transformers builds from them (its block-diagonal causal
    mask, windowed for sliding layers; a BlockMask under flex attention)."""
    import torch
    from transformers import masking_utils

    kwargs: dict[str, Any] = {"position_ids": pos}
    config = model.config
    if config.model_type not in MASKS_WITHOUT_POSITION_IDS:
        return kwargs
    embeds = torch.empty((*pos.shape, 1), dtype=model.dtype, device=pos.device)  # shape, dtype and device only
    masks = {}
    for kind, fn in (("full_attention", masking_utils.create_causal_mask),
                     ("sliding_attention", masking_utils.create_sliding_window_causal_mask)):
        accepted = mask_factory_params(fn)
        args = {"config": config, "inputs_embeds": embeds, "attention_mask": None, "position_ids": pos}
        args.update({k: None for k in ("cache", "past_key_values") if k in accepted})
        if "cache_position" in accepted:  # transformers 4.x / early 5.x
            args["cache_position"] = torch.arange(pos.shape[-1], device=pos.device)
        masks[kind] = fn(**{k: v for k, v in args.items() if k in accepted})
    kwargs["attention_mask"] = masks
    return kwargs


def train_loop(model, workload: Workload, data: TokenData, steps: int, device: str) -> dict[str, Any]:
    """Run ``steps`` AdamW steps on the staged batches; time each one device-synchronised. ``model`` may be wrapped
    for data parallelism (accelerate's DDP or FSDP2: bench_scaling_hf.py), ``data`` that rank's rows."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ADAMW.lr, betas=(ADAMW.b1, ADAMW.b2), eps=ADAMW.eps,
                            weight_decay=ADAMW.weight_decay, fused=(device == "cuda"))
    # Stage every batch on the device before the clock starts (host->device copies not timed).
    ids = torch.from_numpy(data.input_ids.astype(np.int64)).to(device)
    labels = torch.from_numpy(data.hf_labels()).to(device)
    pos = torch.from_numpy(data.positions.astype(np.int64)).to(device) if workload.packed else None
    images = []
    if data.pixel_values is not None:  # the processor's flat form; float32 (the tower casts to its dtype)
        for i in range(steps):
            images.append({k: torch.from_numpy(v).to(device) for k, v in data.hf_vision_inputs(i).items()})
    rope_owners = [m for m in model.modules() if hasattr(m, "get_rope_index") and hasattr(m, "rope_deltas")]
    for m in rope_owners:  # set by each VLM forward that computes M-RoPE positions; a previous task's must not count
        m.rope_deltas = None
    sync = _sync(device)
    allocated_before = 0
    if device == "cuda":
        # Peak of the training phase (weights resident, optimizer state and activations appear
        # during the steps; loading transients not counted). Unsloth's layer-offload planner resets the peak at the first step itself,
        # so resetting here keeps the HF and Unsloth numbers defined the same way.
        sync()
        allocated_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    model.train()
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        # A DistributedDataParallel wrapper (bench_scaling_hf.py) holds the model as .module, config and all.
        kwargs = packed_forward_kwargs(getattr(model, "module", model), pos[i]) if pos is not None else {}
        kwargs.update(images[i] if images else {})
        out = model(input_ids=ids[i], labels=labels[i], use_cache=False, **kwargs)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss.detach().float().item())
        if images and i == 0 and rope_owners and all(m.rope_deltas is None for m in rope_owners):
            raise RuntimeError(f"{workload.name}: the model computed no M-RoPE positions in step 0 (rope_deltas is "
                               "None): it trained on 1-D positions; pass mm_token_type_ids (TokenData.hf_vision_inputs)")
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        del out
    if device == "cuda":
        peak = int(torch.cuda.max_memory_allocated())
        extra = {"peak_memory_kind": "torch.cuda.max_memory_allocated since the first step",
                 "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                 "allocated_before_train_bytes": int(allocated_before)}
    else:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        extra = {"peak_memory_kind": "host ru_maxrss (CPU run)"}
    return {"step_times_s": times, "losses": losses, "peak_memory_bytes": peak,
            "peak_memory_source": "allocator", "extra": extra}


def _check_hf_packing(workload: Workload, data: TokenData) -> str:
    """Confirm transformers will treat our position_ids as packed documents (raise if not)."""
    if not workload.packed:
        return "causal (is_causal=True, no mask)"
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    seg = find_packed_sequence_indices(torch.from_numpy(data.positions[0].astype(np.int64)))
    if seg is None:
        raise RuntimeError("transformers did not detect packed sequences from position_ids")
    got = seg.numpy() + 1
    if not np.array_equal(got, data.segment_ids[0]):
        raise RuntimeError("transformers' packed segments differ from our segment_ids")
    return ("padding-free: position_ids restart per document, no attention_mask, use_cache=False "
            "-> transformers builds a block-diagonal causal 4D bool mask for SDPA")


def _load_hf(model_dir: str, device: str, four_bit: bool = False, dtype=None):
    import json
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    quant = {}
    if four_bit:
        from transformers import BitsAndBytesConfig

        quant["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = auto.from_pretrained(model_dir, dtype=dtype or torch.bfloat16,
                                 attn_implementation=hf_attention(config, device),
                                 device_map=device, trust_remote_code=False, **quant)
    model.config.use_cache = False
    return model


def hf_attention(config: dict[str, Any], device: str) -> str:
    """transformers' attention for HF+PEFT: SDPA, except where transformers refuses it. Attention logit
    soft-capping (Gemma 2) runs only in its eager attention. GPT-OSS's sinks have no SDPA path; on a GPU flex
    attention (its one path without a hub kernel that does not materialise [heads, T, T] per layer), on the CPU,
    where transformers refuses sinks in flex attention, eager."""
    if config.get("attn_logit_softcapping"):
        return "eager"
    if config.get("model_type") == "gpt_oss":
        return "flex_attention" if device == "cuda" else "eager"
    return "sdpa"


def run_hf(task: Task, ckpt: bool, cache: ModelCache, four_bit: bool = False) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    workload = task.workload_obj
    data = make_token_data(workload, task.steps)
    attention = _check_hf_packing(workload, data)
    t0 = time.perf_counter()
    base, reused = cache.get((task.model_dir, task.device, four_bit),
                             lambda: _load_hf(task.model_dir, task.device, four_bit))
    load_s = time.perf_counter() - t0
    if ckpt:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:  # a no-op on a fresh model; undoes an earlier task's setting on a reused one
        # transformers 5.24 renamed it (the old name warns); older versions have only the old name.
        (getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable)()
    torch.manual_seed(0)  # LoRA A's init draws: identical in a fresh process and a reused model
    targets = hf_lora_targets(workload)
    lcfg = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout, bias="none",
                      task_type="CAUSAL_LM", **targets)
    model = get_peft_model(base, lcfg)  # autocast_adapter_dtype=True: LoRA params in fp32
    lora_dtype, n_train, non_lora = _lora_dtype_and_count(model)
    result = train_loop(model, workload, data, task.steps, task.device)
    attn_impl = model.config._attn_implementation
    # Give the base model back as it was loaded (on failure the cache is dropped instead): PEFT
    # swaps its LoRA layers for the original modules in place, and the input-grad hook PEFT adds
    # under gradient checkpointing goes too.
    if model.unload() is not base:
        raise RuntimeError("PeftModel.unload() did not return the cached base model")
    if getattr(base, "_require_grads_hooks", None) or hasattr(base, "_require_grads_hook"):
        base.disable_input_require_grads()
    return {**result, "data_sha256": data.sha256, "lora_param_dtype": lora_dtype,
            "trainable_params": n_train, "base_model_reused": reused,
            "device_name": torch.cuda.get_device_name() if task.device == "cuda" else "cpu",
            "versions": _versions(),
            "settings": {"attn_implementation": attn_impl,
                         "weights": "bitsandbytes nf4 (double quant), bf16 compute" if four_bit else "bf16",
                         "gradient_checkpointing": ckpt,
                         "use_reentrant": False if ckpt else None,
                         "optimizer": f"torch.optim.AdamW(fused={task.device == 'cuda'})",
                         "attention_masking": attention,
                         "lora_targets": targets,
                         "non_lora_trainable": non_lora},
            "extra": {**result["extra"], "model_load_s": load_s}}


def unsloth_peft_kwargs(workload: Workload) -> dict[str, Any]:
    """get_peft_model's keyword arguments (FastLanguageModel, or FastVisionModel for a VLM) training the same
    parameters as jaxft and hf_ckpt: q..down linears; a MoE shape's experts through target_parameters (Unsloth
    would derive the same two from gate/up/down_proj; given explicitly so the row does not depend on its
    detection); a VLM's language layers only (finetune_vision_layers=False: the tower and merger frozen)."""
    kwargs: dict[str, Any] = {"r": LORA.r, "lora_alpha": LORA.alpha, "lora_dropout": LORA.dropout, "bias": "none",
                              "use_gradient_checkpointing": "unsloth", "random_state": 3407}
    if workload.shape.is_vlm:
        kwargs.update(finetune_vision_layers=False, finetune_language_layers=True, finetune_attention_modules=True,
                      finetune_mlp_modules=True)
    else:
        kwargs.update(target_modules=list(lora_module_targets(workload.shape)), max_seq_length=workload.seq_len)
    if moe_layout(workload.shape) is not None:
        kwargs["target_parameters"] = list(LORA.expert_targets)
    return kwargs


def _unsloth_moe_backend() -> str | None:
    """The MoE backend unsloth_zoo chose (grouped_mm / unsloth_triton / native_torch), for the record."""
    try:
        from unsloth_zoo.temporary_patches.moe_utils import select_moe_backend

        return str(select_moe_backend())
    except Exception as e:  # informational only
        return f"unknown ({type(e).__name__}: {str(e)[:200]})"


def run_unsloth(task: Task, four_bit: bool = False, full: bool = False) -> dict[str, Any]:
    if task.device != "cuda":
        raise SystemUnavailable("Unsloth needs a CUDA GPU (its kernels are Triton)")
    if _UNSLOTH_IMPORT_ERROR is not None:
        raise SystemUnavailable(f"import unsloth failed: {type(_UNSLOTH_IMPORT_ERROR).__name__}: "
                                f"{_UNSLOTH_IMPORT_ERROR}")
    import torch

    workload = task.workload_obj
    vlm = workload.shape.is_vlm
    if vlm:
        from unsloth import FastVisionModel as Fast
    else:
        from unsloth import FastLanguageModel as Fast
    data = make_token_data(workload, task.steps)
    load = {"use_gradient_checkpointing": "unsloth"} if vlm or full else {}
    if full:  # every weight trained: no adapter (get_peft_model would wrap the model in one)
        load["full_finetuning"] = True
    peft_kwargs = None if full else unsloth_peft_kwargs(workload)
    try:
        model, _tok = Fast.from_pretrained(
            model_name=task.model_dir, max_seq_length=workload.seq_len, dtype=torch.bfloat16,
            load_in_4bit=four_bit, load_in_16bit=not four_bit, local_files_only=True, **load)
        if not full:
            model = Fast.get_peft_model(model, **peft_kwargs)
        Fast.for_training(model)
    except Exception as e:  # Unsloth refusing a shape is a result (not_run), running out of memory another (oom)
        if is_oom_message(f"{type(e).__name__} {e}"):
            raise
        raise SystemUnavailable(f"Unsloth {Fast.__name__} cannot set up {workload.shape.name} "
                                f"({workload.shape.get('model_type')}): {type(e).__name__}: {str(e)[:1500]}") from e
    lora_dtype, n_train, non_lora = _lora_dtype_and_count(model)
    result = train_loop(model, workload, data, task.steps, task.device)
    backends = {}
    try:
        from unsloth.utils import attention_dispatch as ad

        backends = {"flash_attn": bool(ad.HAS_FLASH_ATTENTION), "xformers": bool(ad.HAS_XFORMERS)}
    except Exception as e:  # informational only
        backends = {"unknown": f"{type(e).__name__}: {e}"}
    return {**result, "data_sha256": data.sha256, "lora_param_dtype": lora_dtype,
            "trainable_params": n_train, "base_model_reused": False,
            "device_name": torch.cuda.get_device_name(),
            "versions": _versions(("unsloth", "unsloth_zoo", "bitsandbytes", "flash_attn",
                                   "xformers")),
            "settings": {"loader": "FastVisionModel" if vlm else "FastLanguageModel",
                         "load_in_16bit": not four_bit, "load_in_4bit": four_bit, "full_finetuning": full,
                         "use_gradient_checkpointing": "unsloth",
                         "optimizer": "torch.optim.AdamW(fused=True)",
                         "attention_backends_available": backends,
                         "packed": "position_ids (Unsloth infers packed_seq_lengths)"
                         if workload.packed else None,
                         "peft_kwargs": peft_kwargs,
                         "moe_backend": _unsloth_moe_backend() if moe_layout(workload.shape) else None,
                         "non_lora_trainable": non_lora,
                         "unsloth_env": _UNSLOTH_CALLER_ENV}}


def step_clock(device: str):
    """A transformers TrainerCallback timing each optimizer step as train_loop does: device-synchronised at
    on_step_begin (the step's batch already fetched) and at on_step_end (after the optimizer step and zero_grad);
    it keeps every log that holds a step's loss (logging_steps=1: one per step, TRL's DPO metrics in it) and, on
    CUDA, resets the allocator's peak just before the first step."""
    import torch
    from transformers import TrainerCallback

    sync = _sync(device)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.logs: list[dict[str, float]] = []
            self.allocated_before = 0
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            if not self.times and device == "cuda":
                self.allocated_before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.times.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append(dict(logs))

    return StepClock()


def pretokenized_dpo_trainer(trainer_cls):
    """`trainer_cls` (TRL's DPOTrainer, or Unsloth's patched one) taking a train dataset that already holds the
    PREFERENCE_COLUMNS. TRL 1.15's `_prepare_dataset` tokenizes prompt/chosen/rejected text and has no switch for
    tokenized pairs, and random token ids do not survive a decode and re-tokenization; its collator reads exactly
    these three columns, so the dataset is handed to it as it is."""

    class PretokenizedDPOTrainer(trainer_cls):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            missing = [c for c in PREFERENCE_COLUMNS if c not in dataset.column_names]
            if missing:
                raise ValueError(f"{dataset_name} dataset: no {missing} column; it must hold {PREFERENCE_COLUMNS}")
            return dataset

    return PretokenizedDPOTrainer


def dpo_args(workload: Workload, device: str, steps: int, output_dir: str, fp32: bool, unsloth: bool):
    """DPOConfig keyword arguments: the workload's pairs in order, one optimizer step per batch of pairs, the
    benchmark's AdamW (constant lr, no clipping) and DPO objective, a loss log per step, nothing saved. TRL's own
    defaults for the rest: gradient checkpointing on for TRL (Unsloth's own from get_peft_model), the reference
    computed each step (precompute_ref_log_probs off), no padding-free batching."""
    kwargs = dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=workload.batch,
                  gradient_accumulation_steps=1, train_sampling_strategy="sequential", learning_rate=ADAMW.lr,
                  adam_beta1=ADAMW.b1, adam_beta2=ADAMW.b2, adam_epsilon=ADAMW.eps, weight_decay=ADAMW.weight_decay,
                  lr_scheduler_type="constant", max_grad_norm=0.0,
                  optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
                  beta=DPO_BETA, loss_type=[DPO_LOSS_TYPE], max_length=workload.seq_len,
                  bf16=not fp32, use_cpu=device == "cpu", seed=0, logging_steps=1, save_strategy="no",
                  report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    if not unsloth:
        kwargs["gradient_checkpointing"] = True  # TRL's default, as TRL users run 8B
    return kwargs


def run_dpo(task: Task, unsloth: bool = False) -> dict[str, Any]:
    """trl_dpo / unsloth_dpo: TRL's `DPOTrainer.train()` on the workload's pairs (module docstring)."""
    workload = task.workload_obj
    if not workload.dpo:
        raise ValueError(f"{task.system} trains DPO; workload {workload.name!r} is not a DPO workload")
    if unsloth and task.device != "cuda":
        raise SystemUnavailable("Unsloth needs a CUDA GPU (its kernels are Triton)")
    if unsloth and _UNSLOTH_IMPORT_ERROR is not None:
        raise SystemUnavailable(f"import unsloth failed: {type(_UNSLOTH_IMPORT_ERROR).__name__}: "
                                f"{_UNSLOTH_IMPORT_ERROR}")
    try:
        import trl
        from datasets import Dataset
    except ImportError as e:
        raise SystemUnavailable(f"{task.system} needs trl and datasets ({type(e).__name__}: {e}); on the device they "
                                "come from the peer wheels (.peers/unsloth: trl-1.15.0, datasets)") from e
    import tempfile

    import torch

    data = make_token_data(workload, task.steps)
    dataset = Dataset.from_list([ex for i in range(task.steps) for ex in data.preference_examples(i)])
    fp32 = workload.tiny and task.device == "cpu"  # as jaxft_worker.run_dtype: the CPU tests compare fp32 runs
    dtype = torch.float32 if fp32 else torch.bfloat16
    t0 = time.perf_counter()
    extra_kwargs: dict[str, Any] = {}
    if unsloth:
        from unsloth import FastLanguageModel, PatchDPOTrainer

        PatchDPOTrainer()  # Unsloth's DPO recipe: then TRL's DPOTrainer, as Unsloth patched it on import
        peft_kwargs = unsloth_peft_kwargs(workload)
        try:
            model, tokenizer = FastLanguageModel.from_pretrained(
                model_name=task.model_dir, max_seq_length=workload.seq_len, dtype=dtype, load_in_4bit=False,
                load_in_16bit=True, local_files_only=True)
            model = FastLanguageModel.get_peft_model(model, **peft_kwargs)
        except Exception as e:
            if is_oom_message(f"{type(e).__name__} {e}"):
                raise
            raise SystemUnavailable(f"Unsloth FastLanguageModel cannot set up {workload.shape.name}: "
                                    f"{type(e).__name__}: {str(e)[:1500]}") from e
        targets: Any = peft_kwargs
    else:
        from peft import LoraConfig
        from transformers import AutoTokenizer

        model = _load_hf(task.model_dir, task.device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
        targets = hf_lora_targets(workload)
        # TRL wraps the model in this adapter (seeded by DPOConfig.seed = 0, as hf_ckpt's torch.manual_seed(0));
        # its reference is then the model with the adapter disabled.
        extra_kwargs["peft_config"] = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout,
                                                 bias="none", task_type="CAUSAL_LM", **targets)
    load_s = time.perf_counter() - t0
    clock = step_clock(task.device)
    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as output_dir:  # TRL's output_dir; nothing is saved
        args = trl.DPOConfig(**dpo_args(workload, task.device, task.steps, output_dir, fp32, unsloth))
        try:
            trainer = pretokenized_dpo_trainer(trl.DPOTrainer)(
                model=model, ref_model=None, args=args, train_dataset=dataset, processing_class=tokenizer,
                callbacks=[clock], **extra_kwargs)
        except Exception as e:
            if not unsloth or is_oom_message(f"{type(e).__name__} {e}"):
                raise
            raise RuntimeError(f"TRL's DPOTrainer as Unsloth patched it ({trl.DPOTrainer.__module__}."
                               f"{trl.DPOTrainer.__name__}) failed to build: {type(e).__name__}: {e}") from e
        # What the trainer will collate, step by step, in its own order: equal to the workload's hash exactly when
        # TRL trains the same pairs untruncated (max_length) and unpadded.
        batches = [(b["input_ids"].cpu().numpy(), b["completion_mask"].cpu().numpy())
                   for b, _ in zip(trainer.get_train_dataloader(), range(task.steps))]
        lora_dtype, n_train, non_lora = _lora_dtype_and_count(trainer.model)
        trainer.train()
    if len(clock.times) != task.steps or len(clock.logs) != task.steps:
        raise RuntimeError(f"the trainer ran {len(clock.times)} steps and logged {len(clock.logs)} losses; "
                           f"expected {task.steps} of each")
    if task.device == "cuda":
        peak = int(torch.cuda.max_memory_allocated())
        memory = {"peak_memory_kind": "torch.cuda.max_memory_allocated since the first step",
                  "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                  "allocated_before_train_bytes": int(clock.allocated_before)}
    else:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        memory = {"peak_memory_kind": "host ru_maxrss (CPU run)"}
    peft_config = getattr(trainer.model, "peft_config", {})
    metrics = [{k: float(v) for k, v in log.items() if "/" in k} for log in clock.logs]
    return {"step_times_s": clock.times, "losses": [float(log["loss"]) for log in clock.logs],
            "peak_memory_bytes": peak, "peak_memory_source": "allocator",
            "data_sha256": preference_sha256(batches), "lora_param_dtype": lora_dtype, "trainable_params": n_train,
            "base_model_reused": False,
            "device_name": torch.cuda.get_device_name() if task.device == "cuda" else "cpu",
            "versions": _versions(("trl", "datasets") + (("unsloth", "unsloth_zoo") if unsloth else ())),
            "settings": {"trainer": f"{type(trainer).__mro__[1].__module__}.{type(trainer).__mro__[1].__name__}",
                         "loader": "FastLanguageModel" if unsloth else "transformers AutoModelForCausalLM",
                         "attn_implementation": getattr(model.config, "_attn_implementation", None),
                         "dtype": str(dtype).replace("torch.", ""), "bf16_autocast": args.bf16,
                         "reference": "the 'ref' adapter (TRL's copy of the initial adapter)" if "ref" in peft_config
                         else "the model with its adapter disabled",
                         "beta": args.beta, "loss_type": list(args.loss_type), "max_length": args.max_length,
                         "precompute_ref_log_probs": args.precompute_ref_log_probs,
                         "padding_free": args.padding_free,
                         "gradient_checkpointing": "unsloth" if unsloth else args.gradient_checkpointing,
                         "gradient_checkpointing_kwargs": args.gradient_checkpointing_kwargs,
                         "optimizer": args.optim, "lora_targets": targets, "non_lora_trainable": non_lora,
                         **({"unsloth_env": _UNSLOTH_CALLER_ENV} if unsloth else {})},
            "extra": {**memory, "model_load_s": load_s, "objective_metrics": metrics}}


def run_task(task: Task, out_json: str, cache: ModelCache) -> dict[str, Any]:
    if task.kind == "save_model":
        from .models import save_random_model

        return save_random_model(task.workload_obj.shape, task.model_dir, task.device)
    if task.system in DPO_SYSTEMS:
        return run_dpo(task, unsloth=task.system == "unsloth_dpo")
    if task.system in HF_SYSTEMS:
        return run_hf(task, ckpt=task.system != "hf_nockpt", cache=cache, four_bit=task.system == "hf_qlora")
    if task.system in UNSLOTH_SYSTEMS:
        return run_unsloth(task, four_bit=task.system == "unsloth_4bit", full=task.system == "unsloth_full")
    raise ValueError(f"scripts.bench.torch_worker: unknown system {task.system!r}; known {SYSTEMS}")


if __name__ == "__main__":
    sys.exit(worker_main(run_task))
