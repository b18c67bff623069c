"""`TrainConfig`: every knob of a LoRA fine-tuning run, validated when it is built.

Key names follow TRL's `SFTConfig` / transformers' `TrainingArguments` where one exists, so a TRL
recipe ports by copying keys. `TrainConfig.from_dict` is the door for untrusted input (YAML files,
`key=value` overrides): it reports every unknown key at once, each with a "did you mean" suggestion and
where it was given (`Where`: the YAML line, or the command line). `__post_init__` checks types (naming key,
value and expected type), ranges, choices and that input paths exist; every failure is a
`TrainConfigError` whose message is one line the CLI can print as is. Errors about one key carry that key
(`TrainConfigError.key`), so `from_dict` can prefix the place the key came from without rewriting text. YAML
files and overrides are read by `jaxft.train.config_file.load_config`.

Memory is one key, `memory`: a preset named for what it buys (`jaxft.execution.MEMORY_PRESETS`, each a measured
benchmark recipe), `auto` by default (the fastest that fits `max_memory_gb`: `jaxft.run.Run`). The mechanisms
behind the presets are fields of one advanced mapping, `execution` (`EXECUTION_MAPPING_KEYS`); an `execution` field
wins over the preset's, field by field, logged. `gradient_checkpointing: true` (the HF/TRL switch) with neither
`memory` nor a remat policy given selects `memory: lean`. The flat spellings of the execution fields (`remat`,
`layer_loop`, ...: `MEMORY_FLAT_KEYS`) still work, each noted as deprecated when read from a file or the command line.

Loss selection, with TRL's two keys, each acting on its own data format only:
`assistant_only_loss` (chat `messages` records; default true: the assistant replies are trained, false: every
token) and `completion_only_loss` (`prompt`/`completion` records; default true: the completion is trained,
false: the prompt too). Plain `text` records always train on every token. TRL defaults
`assistant_only_loss` to false; jaxft trains on what the model should learn to generate in every format.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

from bridge.errors import hub_id_hint
from jaxft.data.pipeline import DataConfig
from jaxft.distributed import DistributedConfig, DistributedConfigError
from jaxft.errors import ConfigError
from jaxft.execution import MEMORY_PRESETS, ExecutionConfig, ExecutionConfigError
from jaxft.lora import LoraConfig, LoraConfigError
from jaxft.models.vision.targets import finetune_targets
from jaxft.quant.config import DEFAULT_SKIP, Fp8Config, QuantConfig, QuantConfigError
from jaxft.sharding import MeshConfig, MeshConfigError
from jaxft.train.dpo import DpoConfig, DpoConfigError
from jaxft.train.optim import OptimConfig, OptimConfigError
from jaxft.train.parts import LOGGING_KEYS, LoggingConfig, MODEL_KEYS, ModelSource, PartError


# `dataset_name` is the dataset key of TRL's `trl sft` (ScriptArguments): here a local path, as `dataset` takes it.
ALIASES = {"max_length": "max_seq_length", "dataset_name": "dataset"}
COMMAND_LINE = "command line"
# TRL's ModelConfig dtype key (`torch_dtype` before TRL 0.20): the weights' dtype, which here is the compute dtype
# `bf16` chooses; "auto" (the checkpoint's) leaves bf16 as it is.
DTYPE_KEYS = ("dtype", "torch_dtype")
DTYPE_BF16 = {"bfloat16": True, "bf16": True, "float32": False, "fp32": False}
# TRL keys with no use here: accepted, each named in one log line with the reason, and dropped. (type, why)
IGNORED_KEYS = {
    "attn_implementation": (str, "jaxft chooses its own attention kernel; its key is attention_implementation "
                                 "(auto, xla, pallas, cudnn)"),
    "use_peft": (bool, "jaxft always trains a LoRA adapter (PEFT format), as use_peft: true does"),
}

logger = logging.getLogger(__name__)


# Part field -> flat key. ExecutionConfig's and OptimConfig's fields are the flat keys themselves.
EXECUTION_KEYS = {k: k for k in ("attention_implementation", "remat", "remat_block", "layer_loop", "ce_chunk_size",
                                  "mlp_chunk_size", "max_memory_gb", "host_memory_gb", "offload_transfer",
                                  "compiler_options", "grouped_matmul_implementation", "moe_dispatch",
                                  "frozen_weights")}
# The memory mechanisms: fields of the `execution` mapping, whose flat spellings are deprecated (`memory` picks them).
MEMORY_FLAT_KEYS = ("remat", "remat_block", "layer_loop", "ce_chunk_size", "mlp_chunk_size", "host_memory_gb",
                    "offload_transfer", "frozen_weights")
# What `execution: {...}` takes: the memory mechanisms and the kernel choices (whose flat keys stay).
EXECUTION_MAPPING_KEYS = MEMORY_FLAT_KEYS + ("attention_implementation", "grouped_matmul_implementation",
                                             "moe_dispatch", "compiler_options")
MEMORY_CHOICES = ("auto", "fast", "balanced", "lean", "max_context")
OPTIM_KEYS = {k: k for k in ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay",
                              "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm")}
QUANT_KEYS = {"quant_type": "bnb_4bit_quant_type", "double_quant": "bnb_4bit_use_double_quant",
              "skip_modules": "llm_int8_skip_modules", "max_rel_error": "bnb_4bit_max_rel_error"}
FINETUNE_KEYS = ("finetune_vision_layers", "finetune_language_layers", "finetune_attention_modules",
                 "finetune_mlp_modules")
LORA_KEYS = {"r": "lora_r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "lora_target_modules",
              "use_rslora": "use_rslora", "target_parameters": "lora_target_parameters",
              "modules_to_save": "modules_to_save", "trainable_token_indices": "trainable_token_indices",
              "ensure_weight_tying": "ensure_weight_tying"}


def part_error(error, fields: Mapping[str, str]) -> "TrainConfigError":
    """A part config's error (it carries `field` and `problem`) stated under the flat key of that field; one that
    is about no key the user wrote (`keyed` false: `jaxft.auto.MemoryBudgetError` of a default budget) as it is."""
    if not getattr(error, "keyed", True):
        return TrainConfigError(error.problem)
    key = fields.get(error.field, error.field)
    return TrainConfigError(f"key {key!r}: {error.problem}", key=key)


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


def _key(default: Any = dataclasses.MISSING, help: str = "") -> Any:
    """A `TrainConfig` field with its one-line help: the one place a key is described (`jaxft.train.config_docs`
    renders docs/cli.md from it)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. Required: `model_name_or_path`, `dataset`, `output_dir`.

    Steps are optimizer steps; one step consumes
    `per_device_train_batch_size * gradient_accumulation_steps * num_devices` packed rows of
    `max_seq_length` tokens. `max_steps > 0` overrides `num_train_epochs`. The eval set (when
    `eval_dataset` is given) is evaluated every `eval_steps` (default: `logging_steps`) and at the end;
    checkpoints are written every `save_steps` and at the end, keeping the newest `save_total_limit`.
    `max_grad_norm: 0` disables clipping; `bf16: false` computes in fp32.
    """

    model_name_or_path: str = _key(help="Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    dataset: str = _key(help="training data: a JSONL/JSON/Parquet file or a `datasets` save_to_disk directory")
    output_dir: str = _key(help="where checkpoints, metrics.jsonl, the loss curve and the adapter are written")
    eval_dataset: str | None = _key(None, "held-out data in the same formats (null: no evaluation)")
    # optimisation
    learning_rate: float = _key(2e-4, "peak learning rate of AdamW")
    per_device_train_batch_size: int = _key(8, "packed rows of max_seq_length tokens per device per micro-batch")
    per_device_eval_batch_size: int | None = _key(None, "packed rows per device in evaluation (null: the train "
                                                        "batch size)")
    gradient_accumulation_steps: int = _key(1, "micro-batches summed into one optimizer step")
    num_train_epochs: float = _key(1.0, "passes over the training data (ignored when max_steps > 0)")
    max_steps: int = _key(-1, "optimizer steps to run; -1: as many as num_train_epochs takes")
    warmup_steps: int = _key(0, "steps of linear warm-up from 0 to learning_rate (wins over warmup_ratio)")
    warmup_ratio: float = _key(0.0, "warm-up as a fraction of the total steps")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = _key(
        "linear", "learning-rate decay after warm-up")
    weight_decay: float = _key(0.0, "AdamW's decoupled weight decay on the LoRA weights")
    adam_beta1: float = _key(0.9, "AdamW's first-moment decay")
    adam_beta2: float = _key(0.999, "AdamW's second-moment decay")
    adam_epsilon: float = _key(1e-8, "AdamW's epsilon")
    max_grad_norm: float = _key(1.0, "global gradient-norm clip; 0 disables clipping")
    # logging / evaluation / checkpoints
    logging_steps: int = _key(10, "steps per logging window (loss, step time, tokens/s, peak memory)")
    eval_steps: int | None = _key(None, "steps between evaluations, also run at the end (null: logging_steps)")
    save_steps: int = _key(500, "steps between orbax checkpoints, also written at the end")
    save_total_limit: int | None = _key(None, "newest checkpoints kept (null: all)")
    eval_strategy: Literal["steps", "epoch", "no"] = _key(
        "steps", "when the eval set is evaluated (TrainingArguments' names): every eval_steps, at each epoch's end, "
                 "or never; steps and epoch also at the end (TRL defaults to no; jaxft to steps)")
    save_strategy: Literal["steps", "epoch", "no"] = _key(
        "steps", "when checkpoints are written: every save_steps and at the end, at each epoch's end and at the end, "
                 "or never (the adapter is still exported)")
    eval_generate_prompts: list[str] | None = _key(
        None, "prompts completed greedily at every evaluation, logged and written to metrics.jsonl as samples (one "
              "user turn when the tokenizer has a chat template, else plain text)")
    eval_generate_max_new_tokens: int = _key(64, "new tokens per eval_generate_prompts sample")
    report_to: Literal["tensorboard", "none"] = _key(
        "tensorboard", "TensorBoard events in output_dir/tensorboard (with tensorboardX or torch installed), or none")
    disable_tqdm: bool = _key(False, "no progress bar")
    resume_from_checkpoint: bool | str | None = _key(
        None, "true: continue from the latest checkpoint in output_dir; a path: from that checkpoint")
    overwrite_output_dir: bool = _key(False, "start over in an output_dir that already holds a run")
    seed: int = _key(42, "seed of the data order, LoRA initialisation and dropout")
    # data
    max_seq_length: int = _key(1024, "tokens per packed row")
    packing: bool = _key(True, "pack documents into rows with block-diagonal attention (only true is supported)")
    completion_only_loss: bool = _key(True, "prompt/completion records: loss on the completion only (false: the "
                                            "prompt too)")
    assistant_only_loss: bool = _key(True, "chat records: loss on the assistant replies only (false: every token)")
    dataset_text_field: str = _key("text", "the record field that holds plain text (TRL's SFTConfig key), for "
                                           "records without messages or prompt/completion")
    image_paths_outside_dataset: bool = _key(
        False, "read image paths that leave the dataset file's folder ('..', absolute paths, links); false refuses "
               "them, so a dataset cannot make a run read any file it can")
    # model / precision / memory
    bf16: bool = _key(True, "compute in bfloat16 (false: float32)")
    attention_implementation: Literal["auto", "reference", "xla", "pallas", "cudnn"] = _key(
        "auto", "attention kernel; auto: cuDNN for single-document rows, Pallas flash for packed rows, the XLA "
                "reference on CPU")
    grouped_matmul_implementation: Literal["auto", "reference", "xla", "pallas_mosaic"] = _key(
        "auto", "MoE experts' grouped matmul; auto: the Mosaic GPU kernels on Hopper in bf16, else lax.ragged_dot "
                "(xla)")
    moe_dispatch: Literal["auto", "per_device", "global"] = _key(
        "auto", "on a mesh, where an MoE layer sorts and multiplies tokens: per_device (each device its own rows, "
                "shard_map) or global; auto: per_device")
    memory: Literal["auto", "fast", "balanced", "lean", "max_context"] | None = _key(
        None, "speed against device memory, one measured mode: auto (the fastest that fits max_memory_gb), fast (no "
              "remat), balanced (layer inputs to host, attention kept), lean (layer inputs to host, the rest "
              "recomputed: Unsloth's memory), max_context (lean plus attention to host and frozen weights streamed "
              "from host: least device memory); null: auto, or lean with gradient_checkpointing; docs/memory.md")
    max_memory_gb: float | None = _key(
        None, "device budget in GiB for memory auto and mesh auto (null: free device memory less max(1 GiB, 5%))")
    gradient_checkpointing: bool = _key(
        False, "HF/TRL's switch: true selects memory: lean (layer inputs in host memory, the rest recomputed) when "
               "neither memory nor execution's remat is given")
    execution: dict | None = _key(
        None, "advanced: the mechanisms behind memory, field by field over its preset, e.g. {remat: offload+attn, "
              "layer_loop: scan, ce_chunk_size: 256, frozen_weights: host}; fields: " + ", ".join(
                  EXECUTION_MAPPING_KEYS) + "; docs/memory.md")
    remat: str | dict | None = _key(None, "deprecated flat key: execution: {remat: ...}")
    remat_block: int | str | None = _key(None, "deprecated flat key: execution: {remat_block: ...}")
    offload_transfer: Literal["auto", "policy", "explicit"] | None = _key(
        None, "deprecated flat key: execution: {offload_transfer: ...}")
    frozen_weights: Literal["auto", "device", "host"] | None = _key(
        None, "deprecated flat key: execution: {frozen_weights: ...}")
    host_memory_gb: float | None = _key(None, "deprecated flat key: execution: {host_memory_gb: ...}")
    mlp_chunk_size: int | None = _key(None, "deprecated flat key: execution: {mlp_chunk_size: ...}")
    layer_loop: Literal["auto", "scan", "unroll"] | None = _key(
        None, "deprecated flat key: execution: {layer_loop: ...}")
    ce_chunk_size: int | None = _key(None, "deprecated flat key: execution: {ce_chunk_size: ...}")
    compiler_options: dict | None = _key(
        None, "XLA options for the training step's program only, e.g. {xla_gpu_enable_dynamic_slice_fusion: true}")
    # LoRA
    lora_r: int = _key(16, "LoRA rank")
    lora_alpha: float = _key(32.0, "LoRA scale numerator (scale alpha/r; alpha/sqrt(r) with use_rslora)")
    lora_dropout: float = _key(0.0, "dropout on the LoRA input")
    lora_target_modules: str | list[str] = _key(
        "all-linear", "all-linear or a list of module names such as [q_proj, v_proj]")
    lora_target_parameters: list[str] | None = _key(
        None, "PEFT's target_parameters: MoE expert parameters, e.g. [experts.gate_up_proj, experts.down_proj]; "
              "needs lora_dropout: 0")
    use_rslora: bool = _key(False, "rank-stabilised LoRA scale alpha/sqrt(r)")
    modules_to_save: list[str] | None = _key(
        None, "PEFT's modules_to_save: train these in full beside the adapters, e.g. [embed_tokens, lm_head] (saved "
              "in the adapter; a tied model gets one copy per name unless ensure_weight_tying)")
    trainable_token_indices: list[int] | dict | None = _key(
        None, "PEFT's trainable tokens: train only these embedding rows (token ids), or {embed_tokens: [...], "
              "lm_head: [...]}; a tied head follows the embedding")
    ensure_weight_tying: bool = _key(
        False, "tied models: one trained table for embed_tokens and lm_head in modules_to_save (PEFT's flag)")
    add_special_tokens: list[str] | None = _key(
        None, "special tokens added to the tokenizer (e.g. a chat template's <|im_start|>, <|im_end|>): the "
              "embeddings grow (transformers' mean init) and these tokens' rows train (trainable_token_indices, "
              "unless modules_to_save trains the tables); the tokenizer is saved with the adapter")
    finetune_vision_layers: bool | None = _key(
        None, "vision-language models: LoRA on the vision blocks (Unsloth's flag; null: true); any finetune_* key "
              "replaces lora_target_modules")
    finetune_language_layers: bool | None = _key(
        None, "vision-language models: LoRA on the language layers (null: true)")
    finetune_attention_modules: bool | None = _key(
        None, "vision-language models: LoRA on the attention linears (null: true)")
    finetune_mlp_modules: bool | None = _key(None, "vision-language models: LoRA on the MLP linears (null: true)")
    save_merged_model: bool = _key(False, "also write the base with the LoRA merged, as an HF checkpoint")
    save_gguf: Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"] | None = _key(
        None, "also write the merged model as one GGUF file (llama.cpp) of this type, with the tokenizer, to "
              "<output_dir>/gguf/")
    # QLoRA (transformers' BitsAndBytesConfig names); a bitsandbytes 4-bit checkpoint loads as stored.
    load_in_4bit: bool = _key(False, "store the frozen linears in bitsandbytes' 4-bit format (QLoRA)")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = _key("nf4", "4-bit code book")
    bnb_4bit_use_double_quant: bool = _key(False, "quantise the block scales too (bitsandbytes' nested absmax)")
    llm_int8_skip_modules: list[str] | None = _key(
        None, "modules kept in the compute dtype, whole or in single layers, e.g. model.layers.1.mlp.down_proj "
              "(null: lm_head, routers, vision towers)")
    bnb_4bit_max_rel_error: float | None = _key(
        None, "keep dense each layer of a module whose relative 4-bit error exceeds this (jaxft's key; null: no "
              "check)")
    load_in_fp8: bool = _key(False, "frozen linears in FP8 (e4m3, a scale per output channel; FP8 GEMMs on "
                             "Ada/Hopper), not with 4-bit")
    mesh: str | dict | None = _key(
        None, "devices per mesh axis {data: D, fsdp: F, tensor: T} (-1: the rest), or auto (null: all on data); "
              "docs/multi-gpu.md")
    distributed: str | dict | None = _key(
        None, "several processes: null (one, unless JAXFT_NUM_PROCESSES is set), off, auto (SLURM / Open MPI) or "
              "{coordinator_address, num_processes, process_id}")
    # objective (TRL's DPOConfig names for DPO; docs/objectives.md)
    trainer: Literal["sft", "dpo"] = _key(
        "sft", "the objective: sft (cross-entropy on the trained tokens) or dpo (direct preference optimisation on "
               "prompt/chosen/rejected records, the reference being the model with its adapters off; a row holds whole "
               "pairs, so TRL's max_length per sequence is half of max_seq_length)")
    beta: float = _key(0.1, "dpo: strength of the pull towards the reference model")
    loss_type: Literal["sigmoid", "robust"] | list[str] = _key(
        "sigmoid", "dpo: sigmoid (DPO's -log sigmoid(beta * margin)) or robust (label noise label_smoothing), or "
                   "TRL's list of one of them")
    label_smoothing: float = _key(0.0, "dpo, loss_type robust: the probability a preference label is flipped, in "
                                       "[0, 0.5)")

    def _build_objective(self):
        """The DPO part (`jaxft.train.dpo.DpoConfig`) with trainer dpo, else None; a DPO key without it, and what the
        adapters-off reference cannot express (base weights trained beside the adapters), are errors."""
        keys = {"beta": "beta", "loss_type": "loss_type", "label_smoothing": "label_smoothing"}
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if self.trainer != "dpo":
            given = [k for k in keys if getattr(self, k) != defaults[k]]
            if given:
                raise TrainConfigError(f"key {given[0]!r} is a DPO setting and trainer is {self.trainer!r}; add "
                                       f"`trainer: dpo` or drop {given[0]}", key=given[0])
            return None
        if isinstance(self.loss_type, list):  # TRL's DPOConfig takes a list of loss types, weighted
            if len(self.loss_type) != 1:
                raise TrainConfigError(f"key 'loss_type': value {self.loss_type!r}; jaxft trains one loss type: give "
                                       "one of sigmoid, robust", key="loss_type")
            object.__setattr__(self, "loss_type", self.loss_type[0])
        for key in ("assistant_only_loss", "completion_only_loss"):
            if not getattr(self, key):
                raise TrainConfigError(f"key {key!r}: false with trainer dpo, whose log-probabilities are the "
                                       f"completion's (the reply) only; drop {key}", key=key)
        for key in ("modules_to_save", "trainable_token_indices", "add_special_tokens"):
            if getattr(self, key):
                raise TrainConfigError(f"key {key!r} with trainer dpo: the DPO reference is the model with its LoRA "
                                       "adapters off, which cannot undo base weights trained beside them; drop "
                                       f"{key}", key=key)
        try:
            return DpoConfig(**{field: getattr(self, key) for field, key in keys.items()})
        except DpoConfigError as e:
            raise part_error(e, keys) from None

    @property
    def objective(self):
        """The training objective's part: `jaxft.train.dpo.DpoConfig` with trainer dpo, None for SFT."""
        return self._objective

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            ok, value = _coerce(value, hints[f.name])
            if not ok and _choices(hints[f.name]) and isinstance(value, str):
                choices = _choices(hints[f.name])
                close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TrainConfigError(
                    f"key {f.name!r}: value {value!r} is not one of {', '.join(map(repr, choices))}{hint}",
                    key=f.name)
            if not ok:
                raise TrainConfigError(
                    f"key {f.name!r}: value {value!r} ({type(value).__name__}) has the wrong type; "
                    f"expected {_type_name(hints[f.name])}", key=f.name)
            object.__setattr__(self, f.name, value)
        self._resolve_memory()
        self._check_ranges()
        self._build_model_and_logging()
        self._check_paths()
        self._build_parts()
        object.__setattr__(self, "_objective", self._build_objective())

    def _build_model_and_logging(self):
        """The model part (it checks the model directory) and the logging part, errors under the flat keys."""
        try:
            logging_part = LoggingConfig(**{field: getattr(self, key) for field, key in LOGGING_KEYS.items()})
        except PartError as e:
            raise part_error(e, LOGGING_KEYS) from None
        object.__setattr__(self, "eval_generate_prompts", logging_part.eval_generate_prompts)  # a list -> tuple
        object.__setattr__(self, "_logging", logging_part)
        quant = self._build_quant()
        try:
            model = ModelSource(path=self.model_name_or_path, dtype="bfloat16" if self.bf16 else "float32",
                                quant=quant)
        except PartError as e:
            raise part_error(e, MODEL_KEYS) from None
        object.__setattr__(self, "_model", model)

    def _build_parts(self):
        """The validated parts a run is built from, each checking its own fields once. Their errors carry the
        field; PART_KEYS turns it into the flat key the user wrote (no message rewriting)."""
        for name, build, fields in (("execution", ExecutionConfig, EXECUTION_KEYS), ("optim", OptimConfig,
                                                                                     OPTIM_KEYS),
                                    ("lora", LoraConfig, LORA_KEYS)):
            values = {field: getattr(self, key) for field, key in fields.items()}
            if name == "lora":
                values["target_modules"] = self._lora_targets()
            if name == "execution":
                values["compiler_options"] = values["compiler_options"] or {}
            try:
                part = build(**values)
            except ExecutionConfigError as e:
                if e.field in (self._given["execution"] or {}):
                    raise TrainConfigError(f"key 'execution': {e.field}: {e.problem}", key="execution") from None
                raise part_error(e, fields) from None
            except (OptimConfigError, LoraConfigError) as e:
                raise part_error(e, fields) from None
            object.__setattr__(self, "execution" if name == "execution" else f"_{name}", part)
        object.__setattr__(self, "remat", self.execution.remat)  # canonical (a mapping becomes its string)

        try:
            object.__setattr__(self, "_mesh", MeshConfig.from_mapping(self.mesh))
        except MeshConfigError as e:
            raise TrainConfigError(str(e), key="mesh") from None

        try:
            object.__setattr__(self, "_distributed", DistributedConfig.from_value(self.distributed))
        except DistributedConfigError as e:
            raise TrainConfigError(str(e), key="distributed") from None

    def _lora_targets(self):
        """lora_target_modules, or the finetune_* keys' choice for a vision-language model (see the field
        help); each contradiction is one error on the key that causes it."""
        given = [k for k in FINETUNE_KEYS if getattr(self, k) is not None]
        if not given:
            return self.lora_target_modules

        key = given[0]
        hf = json.loads((Path(self.model_name_or_path).expanduser() / "config.json").read_text(encoding="utf-8"))
        if "vision_config" not in hf:
            raise TrainConfigError(
                f"key {key!r}: {self.model_name_or_path!r} is a text-only model (model_type "
                f"{hf.get('model_type')!r}); the finetune_* keys choose between the vision and language layers of a "
                "vision-language model (Qwen2-VL, Qwen2.5-VL): drop them and use lora_target_modules", key=key)
        if self.lora_target_modules != "all-linear":
            raise TrainConfigError(
                f"key {key!r}: the finetune_* keys choose the LoRA targets, but lora_target_modules is also given "
                f"({self.lora_target_modules!r}); keep lora_target_modules: all-linear or drop the finetune_* keys",
                key=key)
        flags = {k: getattr(self, k) is not False for k in FINETUNE_KEYS}
        for a, b, what in ((FINETUNE_KEYS[0], FINETUNE_KEYS[1], "layers"), (FINETUNE_KEYS[2], FINETUNE_KEYS[3],
                                                                            "module kinds")):
            if not flags[a] and not flags[b]:
                raise TrainConfigError(f"key {b!r}: {a} and {b} are both false, so no {what} would get LoRA and "
                                       "nothing would train; set one of them to true", key=b)

        try:
            return finetune_targets(hf.get("model_type", ""), **flags)
        except ConfigError as e:
            raise TrainConfigError(f"key {key!r}: {e}", key=key) from None

    def _build_quant(self):
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if self.load_in_fp8 and self.load_in_4bit:
            raise TrainConfigError("keys 'load_in_fp8' and 'load_in_4bit' are both true; the frozen base is FP8 or "
                                   "4-bit, not both: set one of them to false", key="load_in_fp8")
        if self.load_in_fp8:  # llm_int8_skip_modules: kept in the compute dtype, as for 4 bits
            given = [k for f, k in QUANT_KEYS.items() if f != "skip_modules" and getattr(self, k) != defaults[k]]
            if given:
                raise TrainConfigError(f"key {given[0]!r} is a 4-bit setting and load_in_fp8 is true; drop "
                                       f"{given[0]}", key=given[0])
            skip = self.llm_int8_skip_modules
            try:
                return Fp8Config(**({} if skip is None else {"skip_modules": tuple(skip)}))
            except QuantConfigError as e:
                raise part_error(e, QUANT_KEYS) from None
        if not self.load_in_4bit:
            given = [k for k in QUANT_KEYS.values() if getattr(self, k) != defaults[k]]
            if given:
                raise TrainConfigError(f"key {given[0]!r} is set but load_in_4bit is false; add `load_in_4bit: true` "
                                       f"or drop {given[0]}", key=given[0])
            return None
        values = {field: getattr(self, key) for field, key in QUANT_KEYS.items()}
        values["skip_modules"] = tuple(values["skip_modules"]) if values["skip_modules"] is not None else DEFAULT_SKIP
        try:
            return QuantConfig(**values)
        except QuantConfigError as e:
            raise part_error(e, QUANT_KEYS) from None

    @property
    def model(self):
        """The model part (`jaxft.train.parts.ModelSource`): directory, compute dtype, 4-bit quantisation."""
        return self._model

    @property
    def logging(self):
        """The logging part (`jaxft.train.parts.LoggingConfig`): output_dir, log / eval / save cadence, reporting."""
        return self._logging

    @property
    def quant(self):
        """The 4-bit part (`jaxft.quant.QuantConfig`), or None without load_in_4bit (also `model.quant`)."""
        return self._model.quant

    @property
    def optim(self):
        """The optimiser part (`jaxft.train.optim.OptimConfig`)."""
        return self._optim

    @property
    def mesh_config(self):
        """The device mesh (`jaxft.sharding.MeshConfig`), from the `mesh` key."""
        return self._mesh

    @property
    def distributed_config(self):
        """How this process joins the run's others (`jaxft.distributed.DistributedConfig`)."""
        return self._distributed

    @property
    def lora(self):
        """The LoRA part (`jaxft.lora.LoraConfig`)."""
        return self._lora

    def rows_per_step(self, num_devices: int) -> int:
        """Packed rows one optimizer step consumes: per-device batch x accumulation x devices (the devices that
        split batch rows: data x fsdp of the mesh; all of them unless `mesh` has a tensor axis)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * num_devices

    def data(self, num_devices: int):
        """The data part (`jaxft.data.DataConfig`) for a run over `num_devices` devices (the rows per step
        scale with them)."""
        rows = self.rows_per_step(num_devices)
        eval_rows = (self.per_device_eval_batch_size or self.per_device_train_batch_size) * num_devices
        return DataConfig(path=self.dataset, seq_len=self.max_seq_length, batch_size=rows,
                          eval_path=self.eval_dataset, eval_batch_size=eval_rows, seed=self.seed,
                          assistant_only_loss=self.assistant_only_loss,
                          completion_only_loss=self.completion_only_loss, text_field=self.dataset_text_field)

    def _resolve_memory(self):
        """The execution fields of this run: the `memory` preset's, then the `execution` mapping's and the
        deprecated flat keys' over them, field by field (a field given both ways with two values is an error). The
        merged values are written to the flat fields, which `_build_parts` reads; the keys as given are kept for
        `replace`. `gradient_checkpointing` selects `memory: lean` only when neither memory nor a remat policy is
        given; it contradicts remat none and memory fast."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        given = {k: getattr(self, k) for k in ("memory", "execution") + EXECUTION_MAPPING_KEYS}
        object.__setattr__(self, "_given", given)
        nested = self.execution or {}
        unknown = [k for k in nested if k not in EXECUTION_MAPPING_KEYS]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), EXECUTION_MAPPING_KEYS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TrainConfigError(f"key 'execution': unknown field {unknown[0]!r}; {hint}fields: "
                                   f"{', '.join(EXECUTION_MAPPING_KEYS)}", key="execution")
        flat = {k: getattr(self, k) for k in EXECUTION_MAPPING_KEYS if getattr(self, k) != defaults[k]}
        for k in set(flat) & set(nested):
            if flat[k] != nested[k]:
                raise TrainConfigError(f"key {k!r} is given twice, flat ({flat[k]!r}) and under execution "
                                       f"({nested[k]!r}); keep the one under execution", key=k)
        explicit = {**flat, **nested}
        memory = self.memory
        if memory is None:
            memory = "auto"
            if self.gradient_checkpointing and "remat" not in explicit:
                logger.info("gradient_checkpointing=true -> memory: lean (layer inputs in host memory, the rest "
                            "recomputed); set memory to choose another mode")
                memory = "lean"
        if self.gradient_checkpointing and (explicit.get("remat") == "none" or "remat" not in explicit
                                            and memory == "fast"):
            what = "execution's remat: none" if explicit.get("remat") == "none" else "memory: fast (no remat)"
            raise TrainConfigError(f"key 'gradient_checkpointing': true contradicts {what}; drop one of the two, or "
                                   "choose memory: lean", key="gradient_checkpointing")
        preset = MEMORY_PRESETS[memory]
        overridden = [k for k in explicit if k in preset and explicit[k] != preset[k]]
        if self.memory is not None and overridden:
            logger.info("memory: %s; execution wins for %s", memory, ", ".join(
                f"{k}: {explicit[k]!r} (preset {preset[k]!r})" for k in overridden))
        merged = {**preset, **explicit}
        object.__setattr__(self, "memory", memory)
        unset = {f.name: f.default for f in dataclasses.fields(ExecutionConfig) if f.name in MEMORY_FLAT_KEYS}
        for k in EXECUTION_MAPPING_KEYS:
            object.__setattr__(self, k, merged.get(k, unset.get(k, defaults[k])))

    # ------------------------------------------------------------------ validation
    def _check_ranges(self):
        def need(cond: bool, key: str, what: str):
            if not cond:
                raise TrainConfigError(f"key {key!r}: value {getattr(self, key)!r} is invalid; {what}", key=key)

        # model_name_or_path and the logging keys are checked by their parts (jaxft.train.parts).
        need(bool(self.dataset.strip()), "dataset", "give a non-empty path")
        need(bool(self.dataset_text_field.strip()), "dataset_text_field", "give the name of the text field")
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "lora_r"):
            need(getattr(self, key) >= 1, key, "must be an integer >= 1")
        need(self.per_device_eval_batch_size is None or self.per_device_eval_batch_size >= 1,
             "per_device_eval_batch_size", "must be an integer >= 1 (or null)")
        need(self.max_seq_length >= 2, "max_seq_length", "must be an integer >= 2")
        need(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "must be >= 1, or -1 to use num_train_epochs")
        need(self.max_steps >= 1 or self.num_train_epochs > 0, "num_train_epochs",
             "must be > 0 (or set max_steps)")
        targets = self.lora_target_modules
        need(bool(targets) and (isinstance(targets, str) or all(isinstance(t, str) and t for t in targets)),
             "lora_target_modules", "give 'all-linear' or a non-empty list of module names such as [q_proj, v_proj]")
        if isinstance(targets, list):
            object.__setattr__(self, "lora_target_modules", tuple(targets))
        params = self.lora_target_parameters
        need(params is None or (len(params) > 0 and all(isinstance(t, str) and t.strip() for t in params)),
             "lora_target_parameters", "give a non-empty list of parameter names such as "
             "[experts.gate_up_proj, experts.down_proj] (or null)")
        if isinstance(params, list):
            object.__setattr__(self, "lora_target_parameters", tuple(params))
        if isinstance(self.modules_to_save, list):
            object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        tokens = self.add_special_tokens
        need(tokens is None or (len(tokens) > 0 and all(isinstance(t, str) and t.strip() for t in tokens)),
             "add_special_tokens", "give a non-empty list of token strings such as ['<|im_start|>', '<|im_end|>']")
        if isinstance(tokens, list):
            object.__setattr__(self, "add_special_tokens", tuple(tokens))
        need(self.packing, "packing", "only packing=true is supported: documents are packed into rows with "
                                      "block-diagonal attention (no cross-document attention), so it is exact")

    def _check_paths(self):
        for key in ("dataset", "eval_dataset"):  # the model directory is checked by the model part
            value = getattr(self, key)
            if value is not None and not Path(value).expanduser().exists():
                # A Hub id ("HuggingFaceH4/ultrachat_200k") gets the download command: nothing is fetched here.
                hint = hub_id_hint(value, repo_type="dataset")
                raise TrainConfigError(f"key {key!r}: path {value!r} does not exist{hint or '; fix the path'}",
                                       key=key)
        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() not in ("true", "false"):
            if not Path(resume).expanduser().exists():
                raise TrainConfigError(
                    f"key 'resume_from_checkpoint': path {resume!r} does not exist; give a checkpoint directory "
                    "(output_dir/checkpoints or output_dir/checkpoints/<step>) or true for the latest one",
                    key="resume_from_checkpoint")
        elif isinstance(resume, str):
            object.__setattr__(self, "resume_from_checkpoint", resume.lower() == "true")

    # ------------------------------------------------------------------ derived values
    def replace(self, **changes) -> "TrainConfig":
        """A copy with `changes`, the memory and execution keys taken as given (not as merged)."""
        return dataclasses.replace(self, **{**self._given, **changes})

    def to_dict(self) -> dict[str, Any]:
        """The keys: `memory` resolved, `execution` and the flat execution keys as given (`from_dict` of it builds
        this config again, quietly)."""
        out = dataclasses.asdict(self)
        out.update({k: self._given[k] for k in ("execution",) + EXECUTION_MAPPING_KEYS})
        for key in ("lora_target_modules", "lora_target_parameters", "eval_generate_prompts", "llm_int8_skip_modules",
                    "modules_to_save", "add_special_tokens"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        return out

    # ------------------------------------------------------------------ construction from untrusted input
    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config",
                  where: Mapping[Any, Where] | None = None) -> "TrainConfig":
        """Builds a config from a mapping, rejecting unknown keys (all of them in one error, each with a
        suggestion) and missing required ones.

        `source` prefixes errors that are about no single key (e.g. the YAML file name). `where` maps a key, as
        spelled in `values`, to where it was given: that place prefixes the key's own errors instead."""
        if not isinstance(values, Mapping):
            raise TrainConfigError(f"{source}: expected a mapping of key: value, got {type(values).__name__}")
        where = dict(where or {})
        values = _from_trl(values, source, where)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in values if ALIASES.get(key, key) not in names]
        if unknown:
            raise TrainConfigError(_unknown_keys_message(unknown, names, source, where))
        kwargs: dict[str, Any] = {}
        spelled: dict[str, Any] = {}  # field name -> the key as written (the name or an alias)
        for key, value in values.items():
            name = ALIASES.get(key, key)
            if name in kwargs:
                alias = key if key in ALIASES else spelled[name]
                raise TrainConfigError(f"{where.get(key, source)}: key {name!r} is given twice (directly and as "
                                       f"alias {alias!r}); keep one", key=name)
            kwargs[name] = value
            spelled[name] = key
        deprecated = [key for key, value in values.items() if ALIASES.get(key, key) in MEMORY_FLAT_KEYS
                      and value is not None]
        if deprecated:
            logger.warning("%s: deprecated flat key%s %s: choose a mode with memory: (%s), or set the mechanism "
                           "under execution: {%s: ...} (docs/memory.md)", where.get(deprecated[0], source),
                           "s" if len(deprecated) > 1 else "", ", ".join(map(str, deprecated)),
                           ", ".join(MEMORY_CHOICES), deprecated[0])
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise TrainConfigError(f"{source}: required key {missing[0]!r} is missing; add `{missing[0]}: ...`")
        try:
            return cls(**kwargs)
        except TrainConfigError as e:
            place = where.get(spelled[e.key], source) if e.key in spelled else source
            raise TrainConfigError(f"{place}: {e}", key=e.key) from None


def _from_trl(values: Mapping[str, Any], source: str, where: Mapping[Any, Where]) -> dict[str, Any]:
    """`values` with TRL's ModelConfig keys resolved: the dtype key (`DTYPE_KEYS`) becomes `bf16`, the keys of
    `IGNORED_KEYS` are dropped with one log line each; what cannot be honoured is one error naming the key."""
    out = dict(values)

    def error(key: str, problem: str) -> TrainConfigError:
        return TrainConfigError(f"{where.get(key, source)}: key {key!r}: {problem}", key=key)

    for key in ("eval_strategy", "save_strategy"):
        if out.get(key) is False:  # YAML 1.1 reads an unquoted `no` as false
            out[key] = "no"
    for key in DTYPE_KEYS:
        if key not in out:
            continue
        value = out.pop(key)
        if value == "auto":
            logger.info("%s: ignored: %s %r; the compute dtype is bf16's choice (bf16: %s)", where.get(key, source),
                        key, value, out.get("bf16", True))
            continue
        if value not in DTYPE_BF16:
            raise error(key, f"value {value!r} is not one of 'bfloat16', 'float32', 'auto'; jaxft computes in "
                             "bfloat16 or float32: set bfloat16 (or bf16: true)")
        bf16 = DTYPE_BF16[value]
        if "bf16" in out and out["bf16"] != bf16:
            raise error(key, f"{value!r} contradicts bf16: {out['bf16']}; drop one of the two keys")
        out["bf16"] = bf16
    for key, (kind, why) in IGNORED_KEYS.items():
        if key not in out:
            continue
        value = out.pop(key)
        if not isinstance(value, kind) and value is not None:
            raise error(key, f"value {value!r} ({type(value).__name__}) has the wrong type; expected "
                             f"{_type_name(kind)}")
        if key == "use_peft" and value is False:
            raise error(key, "false asks for full fine-tuning; jaxft trains LoRA adapters only: set use_peft: true "
                             "or drop the key")
        logger.info("%s: ignored: %s %r: %s", where.get(key, source), key, value, why)
    return out


def _unknown_keys_message(unknown: list[Any], names: list[str], source: str, where: Mapping[Any, Where]) -> str:
    """One line naming every unknown key, each with where it was given (its line, when the line's prefix is
    its file; "command line" for an override in a file's message) and the closest known key."""
    places = [where.get(key) for key in unknown]
    files = [w.origin for w in places if w is not None and w.origin != COMMAND_LINE]
    if files:
        prefix = files[0]
    elif places and all(w is not None for w in places):
        prefix = COMMAND_LINE
    else:
        prefix = source
    items, unhinted = [], False
    for key, place in zip(unknown, places):
        notes = []
        if place is not None and place.origin == prefix and place.line is not None:
            notes.append(f"line {place.line}")
        elif place is not None and place.origin != prefix:
            notes.append(str(place))
        close = difflib.get_close_matches(str(key), names + list(ALIASES), n=1, cutoff=0.6)
        if close:
            notes.append(f"did you mean {close[0]!r}?")
        unhinted |= not close
        items.append(repr(key) + (f" ({'; '.join(notes)})" if notes else ""))
    head = f"unknown key {items[0]}" if len(items) == 1 else f"unknown keys: {', '.join(items)}"
    return f"{prefix}: {head}" + (f"; known keys: {', '.join(names)}" if unhinted else "")


# ---------------------------------------------------------------------- type checking
def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(matches, value) for a value against a field annotation; ints are accepted (as floats) for floats."""
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
            return True, list(value)
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


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(tp, "__name__",
                                                                                                        str(tp)))
