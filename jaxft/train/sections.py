"""The sections of a `TrainConfig`: one frozen dataclass per section of the keys table (`jaxft.train.keys`).

A section's fields are its keys, with the keys' own names, types and defaults (`keys.section` makes them from
the table). Building a section checks its own values (types, then `check`: ranges, paths, contradictions between
its keys); every failure is a `TrainConfigError` carrying the key. A section that feeds a library object builds it
(`build`), stating that object's errors under the key the user wrote (`keys.part_error`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from bridge.errors import hub_id_hint
from jaxft.distributed import DistributedConfig, DistributedConfigError
from jaxft.errors import ConfigError
from jaxft.memory.execution import MEMORY_PRESETS, ExecutionConfig, ExecutionConfigError
from jaxft.lora import LoraConfig, LoraConfigError
from jaxft.models.vision.targets import finetune_targets
from jaxft.quant.config import DEFAULT_SKIP, Fp8Config, QuantConfig, QuantConfigError
from jaxft.sharding import MeshConfig, MeshConfigError
from jaxft.train.dpo import LOSS_TYPES, DpoConfig, DpoConfigError
from jaxft.train.keys import (BY_NAME, EXECUTION_MAPPING_KEYS, MEMORY_FLAT_KEYS, TrainConfigError, closest,
                              part_error, section)
from jaxft.train.optim import OptimConfig, OptimConfigError

logger = logging.getLogger(__name__)

FINETUNE_KEYS = ("finetune_vision_layers", "finetune_language_layers", "finetune_attention_modules",
                 "finetune_mlp_modules")


def _need(section_obj, ok: bool, key: str, what: str) -> None:
    if not ok:
        value = getattr(section_obj, key)
        value = list(value) if isinstance(value, tuple) else value  # as the user wrote it (a list)
        raise TrainConfigError(f"key {key!r}: value {value!r} is invalid; {what}", key=key)


def _names(values) -> bool:
    """A non-empty tuple of non-empty strings (or None)."""
    return values is None or (len(values) > 0 and all(isinstance(v, str) and v.strip() for v in values))


def _check_exists(key: str, value: str | None, repo_type: str) -> None:
    if value is not None and not Path(value).expanduser().exists():
        # A Hub id ("HuggingFaceH4/ultrachat_200k") gets the download command: nothing is fetched here.
        hint = hub_id_hint(value, repo_type=repo_type)
        raise TrainConfigError(f"key {key!r}: path {value!r} does not exist{hint or '; fix the path'}", key=key)


@section("model")
class ModelSection:
    """The checkpoint a run trains: `model_name_or_path` a local Hugging Face directory (config.json +
    *.safetensors + tokenizer files; nothing is downloaded) or a GGUF file (dequantised on load)."""

    def check(self):
        _need(self, bool(self.model_name_or_path.strip()), "model_name_or_path", "give a non-empty path")
        _check_exists("model_name_or_path", self.model_name_or_path, "model")
        path = Path(self.model_name_or_path).expanduser()
        if not (path.suffix.lower() == ".gguf" and path.is_file()) and not (path / "config.json").is_file():
            raise TrainConfigError(f"key 'model_name_or_path': {self.model_name_or_path!r} has no config.json; give "
                                   "a local Hugging Face model directory (config.json + *.safetensors + tokenizer "
                                   "files)", key="model_name_or_path")
        _need(self, self.max_seq_length >= 2, "max_seq_length", "must be an integer >= 2")
        _need(self, _names(self.add_special_tokens), "add_special_tokens",
              "give a non-empty list of token strings such as ['<|im_start|>', '<|im_end|>']")

    @property
    def dtype(self) -> str:
        """The compute dtype of the frozen weights and activations."""
        return "bfloat16" if self.bf16 else "float32"


@section("data")
class DataSection:
    """Where the records are and how they become rows (`TrainConfig.data_config` adds the sizes)."""

    def check(self):
        _need(self, bool(self.dataset.strip()), "dataset", "give a non-empty path")
        _need(self, bool(self.dataset_text_field.strip()), "dataset_text_field", "give the name of the text field")
        _need(self, self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be an integer >= 1")
        _need(self, self.per_device_eval_batch_size is None or self.per_device_eval_batch_size >= 1,
              "per_device_eval_batch_size", "must be an integer >= 1 (or null)")
        _need(self, self.packing, "packing", "only packing=true is supported: documents are packed into rows with "
                                             "block-diagonal attention (no cross-document attention), so it is exact")
        for key in ("dataset", "eval_dataset"):
            _check_exists(key, getattr(self, key), "dataset")


@section("optim")
class OptimSection:
    """How many optimizer steps, of how many micro-batches, with which schedule (`build`: `OptimConfig`)."""

    def check(self):
        _need(self, self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be an integer >= 1")
        _need(self, self.max_steps == -1 or self.max_steps >= 1, "max_steps",
              "must be >= 1, or -1 to use num_train_epochs")
        _need(self, self.max_steps >= 1 or self.num_train_epochs > 0, "num_train_epochs",
              "must be > 0 (or set max_steps)")

    def build(self) -> OptimConfig:
        try:
            return OptimConfig(**self.field_values())
        except OptimConfigError as e:
            raise part_error(e, "optim") from None


@section("objective")
class ObjectiveSection:
    """The loss a step minimises (`build`: `jaxft.train.dpo.DpoConfig` with trainer dpo, None for sft). What DPO's
    adapters-off reference and completion-only log-probabilities rule out in other sections is
    `TrainConfig`'s check."""

    def check(self):
        if self.trainer != "dpo":
            given = [k.name for k in self.KEYS if k.field and getattr(self, k.name) != k.default]
            if given:
                raise TrainConfigError(f"key {given[0]!r} is a DPO setting and trainer is {self.trainer!r}; add "
                                       f"`trainer: dpo` or drop {given[0]}", key=given[0])
            return
        if isinstance(self.loss_type, tuple):  # TRL's DPOConfig takes a list of loss types, weighted
            if len(self.loss_type) != 1:
                raise TrainConfigError(f"key 'loss_type': value {list(self.loss_type)!r}; jaxft trains one loss type: "
                                       f"give one of {', '.join(LOSS_TYPES)}", key="loss_type")
            object.__setattr__(self, "loss_type", self.loss_type[0])

    def build(self) -> DpoConfig | None:
        if self.trainer != "dpo":
            return None
        try:
            return DpoConfig(**self.field_values())
        except DpoConfigError as e:
            raise part_error(e, "objective") from None


@section("lora")
class LoraSection:
    """The adapter (`build`: `jaxft.lora.LoraConfig`). The finetune_* keys choose the targets of a
    vision-language model in place of lora_target_modules. `finetuning_type: full` trains every weight instead (no
    adapter; `TrainConfig` refuses the LoRA keys then)."""

    def check(self):
        _need(self, self.lora_r >= 1, "lora_r", "must be an integer >= 1")
        targets = self.lora_target_modules
        _need(self, bool(targets) and (isinstance(targets, str) or all(t for t in targets)), "lora_target_modules",
              "give 'all-linear' or a non-empty list of module names such as [q_proj, v_proj]")
        _need(self, _names(self.lora_target_parameters), "lora_target_parameters",
              "give a non-empty list of parameter names such as [experts.gate_up_proj, experts.down_proj] (or null)")

    def build(self, model_dir: str) -> LoraConfig:
        values = self.field_values()
        values["target_modules"] = self._targets(model_dir)
        try:
            return LoraConfig(**values)
        except LoraConfigError as e:
            raise part_error(e, "lora") from None

    def _targets(self, model_dir: str):
        """lora_target_modules, or the finetune_* keys' choice for a vision-language model (see the keys' help);
        each contradiction is one error on the key that causes it."""
        given = [k for k in FINETUNE_KEYS if getattr(self, k) is not None]
        if not given:
            return self.lora_target_modules
        key = given[0]
        hf = json.loads((Path(model_dir).expanduser() / "config.json").read_text(encoding="utf-8"))
        if "vision_config" not in hf:
            raise TrainConfigError(
                f"key {key!r}: {model_dir!r} is a text-only model (model_type {hf.get('model_type')!r}); the "
                "finetune_* keys choose between the vision and language layers of a vision-language model (Qwen2-VL, "
                "Qwen2.5-VL): drop them and use lora_target_modules", key=key)
        if self.lora_target_modules != "all-linear":
            raise TrainConfigError(
                f"key {key!r}: the finetune_* keys choose the LoRA targets, but lora_target_modules is also given "
                f"({self.lora_target_modules!r}); keep lora_target_modules: all-linear or drop the finetune_* "
                "keys", key=key)
        flags = {k: getattr(self, k) is not False for k in FINETUNE_KEYS}
        for a, b, what in ((FINETUNE_KEYS[0], FINETUNE_KEYS[1], "layers"),
                           (FINETUNE_KEYS[2], FINETUNE_KEYS[3], "module kinds")):
            if not flags[a] and not flags[b]:
                raise TrainConfigError(f"key {b!r}: {a} and {b} are both false, so no {what} would get LoRA and "
                                       "nothing would train; set one of them to true", key=b)
        try:
            return finetune_targets(hf.get("model_type", ""), **flags)
        except ConfigError as e:
            raise TrainConfigError(f"key {key!r}: {e}", key=key) from None


@section("quant")
class QuantSection:
    """The frozen linears' storage (`build`: a 4-bit `QuantConfig`, an `Fp8Config`, or None: as stored)."""

    def check(self):
        if self.load_in_fp8 and self.load_in_4bit:
            raise TrainConfigError("keys 'load_in_fp8' and 'load_in_4bit' are both true; the frozen base is FP8 or "
                                   "4-bit, not both: set one of them to false", key="load_in_fp8")
        # llm_int8_skip_modules is also FP8's: kept in the compute dtype, as for 4 bits
        bits4 = [k.name for k in self.KEYS if k.field and getattr(self, k.name) != k.default]
        if self.load_in_fp8 and [k for k in bits4 if k != "llm_int8_skip_modules"]:
            key = next(k for k in bits4 if k != "llm_int8_skip_modules")
            raise TrainConfigError(f"key {key!r} is a 4-bit setting and load_in_fp8 is true; drop {key}", key=key)
        if not self.load_in_fp8 and not self.load_in_4bit and bits4:
            raise TrainConfigError(f"key {bits4[0]!r} is set but load_in_4bit is false; add `load_in_4bit: true` or "
                                   f"drop {bits4[0]}", key=bits4[0])

    def build(self) -> QuantConfig | Fp8Config | None:
        skip = self.llm_int8_skip_modules
        try:
            if self.load_in_fp8:
                return Fp8Config(**({} if skip is None else {"skip_modules": skip}))
            if not self.load_in_4bit:
                return None
            values = self.field_values()
            return QuantConfig(**{**values, "skip_modules": DEFAULT_SKIP if skip is None else skip})
        except QuantConfigError as e:
            raise part_error(e, "quant") from None


@section("memory")
class MemorySection:
    """Speed against device memory: the `memory` preset (`jaxft.memory.execution.MEMORY_PRESETS`), then the `execution`
    mapping's fields and the deprecated flat keys over it, field by field (`build`: `ExecutionConfig`).

    `memory` holds the mode in force (null resolved: auto, or lean by `gradient_checkpointing` when no remat
    policy is given); the other fields hold the keys as given."""

    def check(self):
        object.__setattr__(self, "_given_memory", self.memory)
        nested = self.execution or {}
        unknown = [k for k in nested if k not in EXECUTION_MAPPING_KEYS]
        if unknown:
            close = closest(unknown[0], EXECUTION_MAPPING_KEYS)
            hint = f"did you mean {close!r}? " if close else ""
            raise TrainConfigError(f"key 'execution': unknown field {unknown[0]!r}; {hint}fields: "
                                   f"{', '.join(EXECUTION_MAPPING_KEYS)}", key="execution")
        flat = self.flat()
        for k in sorted(set(flat) & set(nested), key=EXECUTION_MAPPING_KEYS.index):
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
        object.__setattr__(self, "memory", memory)

    def flat(self) -> dict:
        """The mapping fields given as flat keys (those not at their defaults)."""
        return {k: getattr(self, k) for k in EXECUTION_MAPPING_KEYS if getattr(self, k) != BY_NAME[k].default}

    def given(self) -> dict:
        """The keys as written (`memory` before `gradient_checkpointing` chose it), for `TrainConfig.replace`."""
        return {k.name: getattr(self, k.name) for k in self.KEYS} | {"memory": self._given_memory}

    def build(self) -> ExecutionConfig:
        merged = {**MEMORY_PRESETS[self.memory], **self.flat(), **(self.execution or {})}
        unset = {f.name: f.default for f in dataclasses.fields(ExecutionConfig) if f.name in MEMORY_FLAT_KEYS}
        values = {k.field: merged.get(k.name, unset.get(k.name, k.default)) if k.name in EXECUTION_MAPPING_KEYS
                  else getattr(self, k.name) for k in self.KEYS if k.field}
        values["compiler_options"] = values["compiler_options"] or {}
        try:
            return ExecutionConfig(**values)
        except ExecutionConfigError as e:
            if e.field in (self.execution or {}):
                raise TrainConfigError(f"key 'execution': {e.field}: {e.problem}", key="execution") from None
            raise part_error(e, "memory") from None


@section("mesh")
class MeshSection:
    """Devices and processes (`build`: `jaxft.sharding.MeshConfig`, `jaxft.distributed.DistributedConfig`)."""

    def build(self) -> tuple[MeshConfig, DistributedConfig]:
        try:
            mesh = MeshConfig.from_mapping(self.mesh)
        except MeshConfigError as e:
            raise TrainConfigError(str(e), key="mesh") from None
        try:
            return mesh, DistributedConfig.from_value(self.distributed)
        except DistributedConfigError as e:
            raise TrainConfigError(str(e), key="distributed") from None


@section("logging")
class LoggingSection:
    """Outputs and their cadence, in optimizer steps: metrics every `logging_steps`, evaluation (the eval set and
    the greedy samples of `eval_generate_prompts`) every `eval_steps` (None: every `logging_steps`), a checkpoint
    every `save_steps`, the newest `save_total_limit` kept (None: all); what is exported beside the adapter."""

    def check(self):
        _need(self, bool(self.output_dir.strip()), "output_dir", "give a non-empty path")
        for key in ("logging_steps", "save_steps", "eval_generate_max_new_tokens"):
            _need(self, getattr(self, key) >= 1, key, "must be an integer >= 1")
        for key in ("eval_steps", "save_total_limit"):
            _need(self, getattr(self, key) is None or getattr(self, key) >= 1, key,
                  "must be an integer >= 1 (or null)")
        _need(self, _names(self.eval_generate_prompts), "eval_generate_prompts",
              "give a non-empty list of non-empty prompt strings (or null)")
        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() in ("true", "false"):
            object.__setattr__(self, "resume_from_checkpoint", resume.lower() == "true")
        elif isinstance(resume, str) and not Path(resume).expanduser().exists():
            raise TrainConfigError(
                f"key 'resume_from_checkpoint': path {resume!r} does not exist; give a checkpoint directory "
                "(output_dir/checkpoints or output_dir/checkpoints/<step>) or true for the latest one",
                key="resume_from_checkpoint")

    @property
    def eval_every(self) -> int:
        """Steps between evaluations: `eval_steps`, else `logging_steps`."""
        return self.eval_steps or self.logging_steps

    def due(self, what: str, step: int, total: int, steps_per_epoch: int) -> bool:
        """Whether `what` ("eval" or "save") is due after optimizer step `step` of `total`: by its strategy,
        every eval_every / save_steps steps, at each epoch's end, or never; steps and epoch also at the end."""
        strategy = self.eval_strategy if what == "eval" else self.save_strategy
        every = {"steps": self.eval_every if what == "eval" else self.save_steps, "epoch": steps_per_epoch}
        return strategy != "no" and (step == total or step % every[strategy] == 0)


SECTION_CLASSES = {"model": ModelSection, "data": DataSection, "optim": OptimSection, "objective": ObjectiveSection,
                   "lora": LoraSection, "quant": QuantSection, "memory": MemorySection, "mesh": MeshSection,
                   "logging": LoggingSection}
