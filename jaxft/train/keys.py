"""The `jaxft-train` keys: one table (`KEYS`) of every key a user types, in YAML or on the command line.

A row says which section of `TrainConfig` holds the key (`SECTIONS`), its type, default and one-line help, the
field it sets in the library object built from that section (`LoraConfig.r` for `lora_r`), its aliases, and
whether its flat spelling is deprecated. Everything else is read from the table: the section dataclasses'
fields (`section`), type checks and their messages (`coerce`), "did you mean" (`closest`), `jaxft-train --help`,
docs/cli.md (`jaxft.train.config_docs`), and the messages of a built part's error (`key_for`). A key's field in
its section is the key's own name, so one concept has one name from the YAML file to the code.

Adding a key is one `Key(...)` row in its section's block; docs/cli.md is then regenerated
(`python -m jaxft.train.config_docs > docs/cli.md`), and the section's `check` (jaxft/train/sections.py) gets a
range check when the type alone does not say what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

REQUIRED: Any = dataclasses.MISSING
COMMAND_LINE = "command line"


class TrainConfigError(ValueError):
    """A bad training option. The message names the key (and file), the value and the fix.

    `key` is the one config key the error is about (None when it is about several, or none): `from_dict`
    uses it to say where that key was given."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a config key was given: `origin` is a file path (with the key's 1-based `line` when known)
    or `COMMAND_LINE`."""

    origin: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.origin}:{self.line}" if self.line is not None else self.origin


@dataclasses.dataclass(frozen=True)
class Key:
    """One user key: `section` of `TrainConfig` it lives in, annotation `type`, `default` (`REQUIRED`: none), one
    line of `help`; `field`: what it sets in the object built from its section (None: nothing directly, e.g.
    `load_in_4bit` chooses the object); `aliases`: other names for it; `deprecated`: a flat spelling of an
    `execution` field, still read, with one warning."""

    name: str
    section: str
    type: Any
    default: Any
    help: str
    field: str | None = None
    aliases: tuple[str, ...] = ()
    deprecated: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


# Section -> what it holds (the docs' headings). `TrainConfig` has one attribute per section, in this order.
SECTIONS = {
    "model": "the checkpoint, its compute dtype, the sequence length and added tokens",
    "data": "the training and eval data, how records become packed rows, rows per device",
    "optim": "the optimizer, its schedule, how many steps of how many micro-batches, the seed",
    "objective": "what the loss is: cross-entropy (sft) or DPO on preference pairs (TRL's DPOConfig names; built: "
                 "jaxft.train.dpo.DpoConfig); docs/objectives.md",
    "lora": "what is trained: LoRA adapters (rank, scale, targets, fully trained modules and token rows; built: "
            "jaxft.lora.LoraConfig) or every weight (finetuning_type: full)",
    "quant": "the frozen weights in 4 bits (transformers' BitsAndBytesConfig names) or FP8",
    "memory": "speed against device memory, and the kernels a step uses (built: memory.execution.ExecutionConfig)",
    "mesh": "devices and processes",
    "logging": "outputs: where, how often the run logs, evaluates and saves, what is exported",
}

MEMORY_CHOICES = ("auto", "fast", "balanced", "lean", "max_context")
# The kernel choices that `execution: {...}` takes beside the deprecated flat memory keys (whose flat keys stay).
EXECUTION_KERNEL_KEYS = ("attention_implementation", "grouped_matmul_implementation", "moe_dispatch",
                         "compiler_options")
_FLAT = "deprecated flat key: execution: {{{}: ...}}"


def _deprecated(name: str, tp: Any) -> Key:
    """A memory mechanism's deprecated flat key: a field of the `execution` mapping."""
    return Key(name, "memory", tp, None, _FLAT.format(name), field=name, deprecated=True)


KEYS: tuple[Key, ...] = (
    # model
    Key("model_name_or_path", "model", str, REQUIRED,
        "Hugging Face model directory (config.json, *.safetensors, tokenizer)"),
    Key("max_seq_length", "model", int, 1024, "tokens per packed row", aliases=("max_length",)),
    Key("bf16", "model", bool, True, "compute in bfloat16 (false: float32)"),
    Key("add_special_tokens", "model", list[str] | None, None,
        "special tokens added to the tokenizer (e.g. a chat template's <|im_start|>, <|im_end|>): the embeddings "
        "grow (transformers' mean init) and these tokens' rows train (trainable_token_indices, unless "
        "modules_to_save trains the tables); the tokenizer is saved with the adapter"),
    # data
    Key("dataset", "data", str, REQUIRED,
        "training data: a JSONL/JSON/Parquet file or a `datasets` save_to_disk directory", aliases=("dataset_name",)),
    Key("eval_dataset", "data", str | None, None, "held-out data in the same formats (null: no evaluation)"),
    Key("per_device_train_batch_size", "data", int, 8,
        "packed rows of max_seq_length tokens per device per micro-batch"),
    Key("per_device_eval_batch_size", "data", int | None, None,
        "packed rows per device in evaluation (null: the train batch size)"),
    Key("packing", "data", bool, True,
        "pack documents into rows with block-diagonal attention (only true is supported)"),
    Key("completion_only_loss", "data", bool, True,
        "prompt/completion records: loss on the completion only (false: the prompt too)"),
    Key("assistant_only_loss", "data", bool, True,
        "chat records: loss on the assistant replies only (false: every token)"),
    Key("dataset_text_field", "data", str, "text",
        "the record field that holds plain text (TRL's SFTConfig key), for records without messages or "
        "prompt/completion"),
    Key("image_paths_outside_dataset", "data", bool, False,
        "read image paths that leave the dataset file's folder ('..', absolute paths, links); false refuses them, "
        "so a dataset cannot make a run read any file it can"),
    # optim
    Key("learning_rate", "optim", float, 2e-4, "peak learning rate of AdamW", field="learning_rate"),
    Key("gradient_accumulation_steps", "optim", int, 1, "micro-batches summed into one optimizer step"),
    Key("num_train_epochs", "optim", float, 1.0, "passes over the training data (ignored when max_steps > 0)"),
    Key("max_steps", "optim", int, -1, "optimizer steps to run; -1: as many as num_train_epochs takes"),
    Key("warmup_steps", "optim", int, 0, "steps of linear warm-up from 0 to learning_rate (wins over warmup_ratio)",
        field="warmup_steps"),
    Key("warmup_ratio", "optim", float, 0.0, "warm-up as a fraction of the total steps", field="warmup_ratio"),
    Key("lr_scheduler_type", "optim", Literal["linear", "cosine", "constant", "constant_with_warmup"], "linear",
        "learning-rate decay after warm-up", field="lr_scheduler_type"),
    Key("weight_decay", "optim", float, 0.0, "AdamW's decoupled weight decay on the LoRA weights",
        field="weight_decay"),
    Key("optim", "optim", str, "adamw_torch",
        "AdamW's moments: adamw_torch (fp32, 8 bytes a weight) or adamw_8bit (blockwise 8-bit as bitsandbytes' "
        "AdamW8bit, about 2; pays in full fine-tuning); adamw_torch_fused, adamw_bnb_8bit, paged_adamw_8bit "
        "are read as these", field="optim"),
    Key("adam_beta1", "optim", float, 0.9, "AdamW's first-moment decay", field="adam_beta1"),
    Key("adam_beta2", "optim", float, 0.999, "AdamW's second-moment decay", field="adam_beta2"),
    Key("adam_epsilon", "optim", float, 1e-8, "AdamW's epsilon", field="adam_epsilon"),
    Key("max_grad_norm", "optim", float, 1.0, "global gradient-norm clip; 0 disables clipping", field="max_grad_norm"),
    Key("seed", "optim", int, 42, "seed of the data order, LoRA initialisation and dropout"),
    # objective
    Key("trainer", "objective", Literal["sft", "dpo"], "sft",
        "the objective: sft (cross-entropy on the trained tokens) or dpo (direct preference optimisation on "
        "prompt/chosen/rejected records, the reference being the model with its adapters off; a row holds whole "
        "pairs, so TRL's max_length per sequence is half of max_seq_length)"),
    Key("beta", "objective", float, 0.1, "dpo: strength of the pull towards the reference model", field="beta"),
    Key("loss_type", "objective", Literal["sigmoid", "robust", "hinge", "ipo"] | list[str], "sigmoid",
        "dpo: sigmoid (DPO's -log sigmoid(beta * margin)), robust (label noise label_smoothing), hinge (SLiC's "
        "max(0, 1 - beta * margin)) or ipo (IPO's squared loss on per-token margins), or TRL's list of one of them",
        field="loss_type"),
    Key("label_smoothing", "objective", float, 0.0,
        "dpo, loss_type robust: the probability a preference label is flipped, in [0, 0.5)", field="label_smoothing"),
    # lora
    Key("finetuning_type", "lora", Literal["lora", "full"], "lora",
        "lora: train LoRA adapters (exported as a PEFT adapter); full: train every weight (fp32 masters and AdamW "
        "state, exported as an HF checkpoint to output_dir/model; TRL's use_peft: false and Unsloth's "
        "full_finetuning: true mean the same); docs/full-finetuning.md"),
    Key("lora_r", "lora", int, 16, "LoRA rank", field="r"),
    Key("lora_alpha", "lora", float, 32.0, "LoRA scale numerator (scale alpha/r; alpha/sqrt(r) with use_rslora)",
        field="alpha"),
    Key("lora_dropout", "lora", float, 0.0, "dropout on the LoRA input", field="dropout"),
    Key("lora_target_modules", "lora", str | list[str], "all-linear",
        "all-linear or a list of module names such as [q_proj, v_proj]", field="target_modules"),
    Key("lora_target_parameters", "lora", list[str] | None, None,
        "PEFT's target_parameters: MoE expert parameters, e.g. [experts.gate_up_proj, experts.down_proj]; needs "
        "lora_dropout: 0", field="target_parameters"),
    Key("use_rslora", "lora", bool, False, "rank-stabilised LoRA scale alpha/sqrt(r)", field="use_rslora"),
    Key("modules_to_save", "lora", list[str] | None, None,
        "PEFT's modules_to_save: train these in full beside the adapters, e.g. [embed_tokens, lm_head] (saved in "
        "the adapter; a tied model gets one copy per name unless ensure_weight_tying)", field="modules_to_save"),
    Key("trainable_token_indices", "lora", list[int] | dict | None, None,
        "PEFT's trainable tokens: train only these embedding rows (token ids), or {embed_tokens: [...], lm_head: "
        "[...]}; a tied head follows the embedding", field="trainable_token_indices"),
    Key("ensure_weight_tying", "lora", bool, False,
        "tied models: one trained table for embed_tokens and lm_head in modules_to_save (PEFT's flag)",
        field="ensure_weight_tying"),
    Key("finetune_vision_layers", "lora", bool | None, None,
        "vision-language models: LoRA on the vision blocks (Unsloth's flag; null: true); any finetune_* key "
        "replaces lora_target_modules"),
    Key("finetune_language_layers", "lora", bool | None, None,
        "vision-language models: LoRA on the language layers (null: true)"),
    Key("finetune_attention_modules", "lora", bool | None, None,
        "vision-language models: LoRA on the attention linears (null: true)"),
    Key("finetune_mlp_modules", "lora", bool | None, None,
        "vision-language models: LoRA on the MLP linears (null: true)"),
    # quant
    Key("load_in_4bit", "quant", bool, False, "store the frozen linears in bitsandbytes' 4-bit format (QLoRA)"),
    Key("bnb_4bit_quant_type", "quant", Literal["nf4", "fp4"], "nf4", "4-bit code book", field="quant_type"),
    Key("bnb_4bit_use_double_quant", "quant", bool, False, "quantise the block scales too (bitsandbytes' nested "
        "absmax)", field="double_quant"),
    Key("llm_int8_skip_modules", "quant", list[str] | None, None,
        "modules kept in the compute dtype, whole or in single layers, e.g. model.layers.1.mlp.down_proj (null: "
        "lm_head, routers, vision towers)", field="skip_modules"),
    Key("bnb_4bit_max_rel_error", "quant", float | None, None,
        "keep dense each layer of a module whose relative 4-bit error exceeds this (jaxft's key; null: no check)",
        field="max_rel_error"),
    Key("load_in_fp8", "quant", bool, False,
        "frozen linears in FP8 (e4m3, a scale per output channel; FP8 GEMMs on Ada/Hopper), not with 4-bit"),
    # memory
    Key("memory", "memory", Literal["auto", "fast", "balanced", "lean", "max_context"] | None, None,
        "speed against device memory, one measured mode: auto (the fastest that fits max_memory_gb), fast (no "
        "remat), balanced (layer inputs to host, attention kept), lean (layer inputs to host, the rest recomputed: "
        "Unsloth's memory), max_context (lean plus attention to host and frozen weights streamed from host: least "
        "device memory); null: auto, or lean with gradient_checkpointing; docs/memory.md"),
    Key("max_memory_gb", "memory", float | None, None,
        "device budget in GiB for memory auto and mesh auto (null: free device memory less max(1 GiB, 5%))",
        field="max_memory_gb"),
    Key("gradient_checkpointing", "memory", bool, False,
        "HF/TRL's switch: true selects memory: lean (layer inputs in host memory, the rest recomputed) when neither "
        "memory nor execution's remat is given"),
    Key("execution", "memory", dict | None, None,
        "advanced: the mechanisms behind memory, field by field over its preset, e.g. {remat: offload+attn, "
        "layer_loop: scan, ce_chunk_size: 256, frozen_weights: host}; fields: remat, remat_block, layer_loop, "
        "ce_chunk_size, mlp_chunk_size, host_memory_gb, offload_transfer, frozen_weights, "
        + ", ".join(EXECUTION_KERNEL_KEYS) + "; docs/memory.md"),
    Key("attention_implementation", "memory", Literal["auto", "reference", "xla", "pallas", "cudnn"], "auto",
        "attention kernel; auto: cuDNN for single-document rows, Pallas flash for packed rows, the XLA reference on "
        "CPU", field="attention_implementation"),
    Key("grouped_matmul_implementation", "memory", Literal["auto", "reference", "xla", "pallas_mosaic"], "auto",
        "MoE experts' grouped matmul; auto: the Mosaic GPU kernels on Hopper in bf16, else lax.ragged_dot (xla)",
        field="grouped_matmul_implementation"),
    Key("moe_dispatch", "memory", Literal["auto", "per_device", "global"], "auto",
        "on a mesh, where an MoE layer sorts and multiplies tokens: per_device (each device its own rows, "
        "shard_map) or global; auto: per_device", field="moe_dispatch"),
    Key("compiler_options", "memory", dict | None, None,
        "XLA options for the training step's program only, e.g. {xla_gpu_enable_dynamic_slice_fusion: true}",
        field="compiler_options"),
    _deprecated("remat", str | dict | None),
    _deprecated("remat_block", int | str | None),
    _deprecated("offload_transfer", Literal["auto", "policy", "explicit"] | None),
    _deprecated("frozen_weights", Literal["auto", "device", "host"] | None),
    _deprecated("host_memory_gb", float | None),
    _deprecated("mlp_chunk_size", int | None),
    _deprecated("layer_loop", Literal["auto", "scan", "unroll"] | None),
    _deprecated("ce_chunk_size", int | None),
    # mesh
    Key("mesh", "mesh", str | dict | None, None,
        "devices per mesh axis {data: D, fsdp: F, tensor: T} (-1: the rest), or auto (null: all on data); "
        "docs/multi-gpu.md"),
    Key("distributed", "mesh", str | dict | None, None,
        "several processes: null (one, unless JAXFT_NUM_PROCESSES is set), off, auto (SLURM / Open MPI) or "
        "{coordinator_address, num_processes, process_id}"),
    # logging
    Key("output_dir", "logging", str, REQUIRED,
        "where checkpoints, metrics.jsonl, the loss curve and the adapter are written"),
    Key("logging_steps", "logging", int, 10, "steps per logging window (loss, step time, tokens/s, peak memory)"),
    Key("eval_steps", "logging", int | None, None,
        "steps between evaluations, also run at the end (null: logging_steps)"),
    Key("save_steps", "logging", int, 500, "steps between orbax checkpoints, also written at the end"),
    Key("save_total_limit", "logging", int | None, None, "newest checkpoints kept (null: all)"),
    Key("eval_strategy", "logging", Literal["steps", "epoch", "no"], "steps",
        "when the eval set is evaluated (TrainingArguments' names): every eval_steps, at each epoch's end, or never; "
        "steps and epoch also at the end (TRL defaults to no; jaxft to steps)"),
    Key("save_strategy", "logging", Literal["steps", "epoch", "no"], "steps",
        "when checkpoints are written: every save_steps and at the end, at each epoch's end and at the end, or never "
        "(the adapter is still exported)"),
    Key("eval_generate_prompts", "logging", list[str] | None, None,
        "prompts completed greedily at every evaluation, logged and written to metrics.jsonl as samples (one user "
        "turn when the tokenizer has a chat template, else plain text)"),
    Key("eval_generate_max_new_tokens", "logging", int, 64, "new tokens per eval_generate_prompts sample"),
    Key("report_to", "logging", Literal["tensorboard", "none"], "tensorboard",
        "TensorBoard events in output_dir/tensorboard (with tensorboardX or torch installed), or none"),
    Key("disable_tqdm", "logging", bool, False, "no progress bar"),
    Key("resume_from_checkpoint", "logging", bool | str | None, None,
        "true: continue from the latest checkpoint in output_dir; a path: from that checkpoint"),
    Key("overwrite_output_dir", "logging", bool, False, "start over in an output_dir that already holds a run"),
    Key("save_merged_model", "logging", bool, False, "also write the base with the LoRA merged, as an HF checkpoint"),
    Key("save_gguf", "logging", Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"] | None, None,
        "also write the merged model as one GGUF file (llama.cpp) of this type, with the tokenizer, to "
        "<output_dir>/gguf/"),
)

BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
# Another name -> the key (`dataset_name` is the dataset key of TRL's `trl sft`: here a local path).
ALIASES: dict[str, str] = {alias: k.name for k in KEYS for alias in k.aliases}
# The memory mechanisms whose flat spellings are deprecated (`memory` picks them; `execution` sets them).
MEMORY_FLAT_KEYS = tuple(k.name for k in KEYS if k.deprecated)
# What `execution: {...}` takes: the memory mechanisms and the kernel choices.
EXECUTION_MAPPING_KEYS = MEMORY_FLAT_KEYS + EXECUTION_KERNEL_KEYS

# TRL's ModelConfig dtype key (`torch_dtype` before TRL 0.20): the weights' dtype, which here is the compute dtype
# `bf16` chooses; "auto" (the checkpoint's) leaves bf16 as it is.
DTYPE_KEYS = ("dtype", "torch_dtype")
DTYPE_BF16 = {"bfloat16": True, "bf16": True, "float32": False, "fp32": False}
# TRL keys with no use here: accepted, each named in one log line with the reason, and dropped. (type, why)
IGNORED_KEYS = {
    "attn_implementation": (str, "jaxft chooses its own attention kernel; its key is attention_implementation "
                                 "(auto, xla, pallas, cudnn)"),
    "use_peft": (bool, "true is jaxft's default, finetuning_type: lora (a PEFT adapter); false is read as "
                       "finetuning_type: full"),
}
# Other libraries' switches for full fine-tuning, read as `finetuning_type: full` (TRL's ModelConfig, Unsloth).
FULL_SWITCHES = {"use_peft": False, "full_finetuning": True}


def section_keys(section: str) -> tuple[Key, ...]:
    return tuple(k for k in KEYS if k.section == section)


def key_for(section: str, field: str) -> str:
    """The key that sets `field` of the object built from `section` (the field itself when no key does)."""
    return next((k.name for k in KEYS if k.section == section and k.field == field), field)


def part_error(error, section: str) -> TrainConfigError:
    """A built part's error (it carries `field` and `problem`) stated under the key that sets that field; one that
    is about no key the user wrote (`keyed` false: `jaxft.memory.choice.MemoryBudgetError` of a default budget) as
    it is."""
    if not getattr(error, "keyed", True):
        return TrainConfigError(error.problem)
    key = key_for(section, error.field)
    return TrainConfigError(f"key {key!r}: {error.problem}", key=key)


def closest(word: Any, names, cutoff: float = 0.6) -> str | None:
    """The known name closest to `word` ("did you mean"), or None."""
    close = difflib.get_close_matches(str(word), list(names), n=1, cutoff=cutoff)
    return close[0] if close else None


def section(name: str):
    """Class decorator: the frozen, keyword-only dataclass of section `name`, one field per key of the section
    (type, default and help from `KEYS`). Building one checks every field's type (`coerce`), then calls the
    class's own `check` for ranges and values the type does not rule out; `field_values()` gives the keys' values
    by the field each sets in the object the section builds."""

    def make(cls):
        keys = section_keys(name)
        cls.__annotations__ = {k.name: k.type for k in keys}
        for k in keys:
            setattr(cls, k.name, dataclasses.field(default=k.default, metadata={"help": k.help}))
        own_check = getattr(cls, "check", None)

        def __post_init__(self):
            for k in keys:
                object.__setattr__(self, k.name, coerce(k.name, getattr(self, k.name)))
            if own_check is not None:
                own_check(self)

        def field_values(self) -> dict[str, Any]:
            """{field of the object the section builds: this section's value} of every key that sets one."""
            return {k.field: getattr(self, k.name) for k in keys if k.field}

        cls.__post_init__ = __post_init__
        cls.field_values = field_values
        cls.KEYS = keys
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)

    return make


# ---------------------------------------------------------------------- type checking
def coerce(key: str, value: Any) -> Any:
    """`value` as key `key`'s type (an int for a float key becomes a float; a list for a list key a tuple, so the
    config stays hashable), or a `TrainConfigError` naming the key, the value and what it takes."""
    tp = BY_NAME[key].type
    ok, out = _coerce(value, tp)
    if ok:
        return out
    choices = _choices(tp)
    if choices and isinstance(value, str):
        close = closest(value, choices, cutoff=0.5)
        hint = f"; did you mean {close!r}?" if close else ""
        raise TrainConfigError(f"key {key!r}: value {value!r} is not one of {', '.join(map(repr, choices))}{hint}",
                               key=key)
    raise TrainConfigError(f"key {key!r}: value {value!r} ({type(value).__name__}) has the wrong type; "
                           f"expected {type_phrase(tp)}", key=key)


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(matches, value) for a value against an annotation; ints are accepted (as floats) for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            ok, out = _coerce(value, arm)
            if ok:
                return True, out
        return False, value
    if tp is type(None):
        return value is None, value
    if origin is Literal:
        return (isinstance(value, str) and value in typing.get_args(tp)), value
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and all(_coerce(v, item)[0] for v in value):
            return True, tuple(value)
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return isinstance(value, tp), value


def _choices(tp: Any) -> tuple[str, ...]:
    """The allowed strings of a Literal annotation (also inside an Optional), else ()."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return sum((_choices(a) for a in typing.get_args(tp)), ())
    return ()


def type_phrase(tp: Any) -> str:
    """An annotation as an error message says what a key takes: `an integer or null`, `one of 'a', 'b'`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_phrase(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {type_phrase(typing.get_args(tp)[0])}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def type_name(tp: Any) -> str:
    """An annotation as a config author reads it in the docs: `int`, `float or null`, `linear | cosine`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(arm) for arm in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(str(choice) for choice in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def default_text(key: Key) -> str:
    """The key's default in YAML spelling ("required" when it has none)."""
    value = key.default
    if value is REQUIRED:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
