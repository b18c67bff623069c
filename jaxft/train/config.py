"""`TrainConfig`: every knob of a LoRA fine-tuning run, in sections, validated when it is built.

The user writes flat keys (TRL's `SFTConfig` / transformers' `TrainingArguments` names where one exists, so a
TRL recipe ports by copying keys); the keys table (`jaxft.train.keys.KEYS`) says which section holds each, and a
`TrainConfig` is one frozen dataclass per section (`config.model.max_seq_length`, `config.optim.learning_rate`,
`jaxft.train.sections`) plus the library objects built from them (`lora_config`, `quant_config`, `optim_config`,
`execution_config`, `mesh_config`, `distributed_config`, `objective_config`). A rule across sections (what a full
fine-tune or DPO rules out elsewhere) is a check of `TrainConfig` itself. `TrainConfig(**keys)` builds one from
trusted keys; `TrainConfig.from_dict` is the door for untrusted input (YAML files, `key=value` overrides): it
reports every unknown key at once, each with a "did you mean" suggestion and where it was given (`Where`: the
YAML line, or the command line), and prefixes a key's error with that place. Every failure is a
`TrainConfigError` whose message is one line the CLI can print as is. YAML files and overrides are read by
`jaxft.train.config_file.load_config`.

Memory is one key, `memory`: a preset named for what it buys (`jaxft.memory.execution.MEMORY_PRESETS`, each a measured
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
import logging
from typing import Any, Mapping

from jaxft.data.pipeline import DataConfig
from jaxft.distributed import DistributedConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig
from jaxft.quant.config import Fp8Config, QuantConfig
from jaxft.sharding import MeshConfig
from jaxft.train.dpo import DpoConfig
from jaxft.train.keys import (ALIASES, BY_NAME, COMMAND_LINE, DTYPE_BF16, DTYPE_KEYS, FULL_SWITCHES, IGNORED_KEYS,
                              KEYS, MEMORY_CHOICES, MEMORY_FLAT_KEYS, SECTIONS, TrainConfigError, Where, closest,
                              section_keys, type_phrase)
from jaxft.train.optim import OptimConfig
from jaxft.train.sections import (SECTION_CLASSES, DataSection, LoggingSection, LoraSection, MemorySection,
                                  MeshSection, ModelSection, ObjectiveSection, OptimSection, QuantSection)

__all__ = ["COMMAND_LINE", "TrainConfig", "TrainConfigError", "Where"]

logger = logging.getLogger(__name__)


def _built():
    return dataclasses.field(init=False, repr=False, compare=False)


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
    """A training run: one section per part of the keys table. Required keys: `model_name_or_path`, `dataset`,
    `output_dir`.

    Steps are optimizer steps; one step consumes
    `per_device_train_batch_size * gradient_accumulation_steps * num_devices` packed rows of
    `max_seq_length` tokens. `max_steps > 0` overrides `num_train_epochs`. The eval set (when
    `eval_dataset` is given) is evaluated every `eval_steps` (default: `logging_steps`) and at the end;
    checkpoints are written every `save_steps` and at the end, keeping the newest `save_total_limit`.
    `max_grad_norm: 0` disables clipping; `bf16: false` computes in fp32.
    """

    model: ModelSection
    data: DataSection
    optim: OptimSection
    objective: ObjectiveSection
    lora: LoraSection
    quant: QuantSection
    memory: MemorySection
    mesh: MeshSection
    logging: LoggingSection
    lora_config: LoraConfig = _built()
    quant_config: QuantConfig | Fp8Config | None = _built()
    optim_config: OptimConfig = _built()
    execution_config: ExecutionConfig = _built()
    mesh_config: MeshConfig = _built()
    distributed_config: DistributedConfig = _built()
    objective_config: DpoConfig | None = _built()

    def __init__(self, **keys: Any):
        """A config from keys (their canonical names, no aliases), as keyword arguments: an unknown or missing one
        is Python's TypeError (`from_dict` is the door for a user's keys). Each section checks its own keys, then
        the library objects are built from the sections."""
        unknown = [key for key in keys if key not in BY_NAME]
        if unknown:
            raise TypeError(f"TrainConfig() got an unexpected keyword argument: "
                            f"{_unknown_keys_message(unknown, 'config', {})}")
        missing = [k.name for k in KEYS if k.required and k.name not in keys]
        if missing:
            raise TypeError(f"TrainConfig() missing required keyword argument {missing[0]!r}")
        for name in SECTIONS:
            cls = SECTION_CLASSES[name]
            object.__setattr__(self, name, cls(**{k.name: keys[k.name] for k in cls.KEYS if k.name in keys}))
        self._check_full()
        object.__setattr__(self, "quant_config", self.quant.build())
        object.__setattr__(self, "execution_config", self._full_execution(self.memory.build()))
        object.__setattr__(self, "optim_config", self.optim.build())
        object.__setattr__(self, "lora_config", self.lora.build(self.model.model_name_or_path))
        mesh, distributed = self.mesh.build()
        object.__setattr__(self, "mesh_config", mesh)
        object.__setattr__(self, "distributed_config", distributed)
        self._check_dpo()
        object.__setattr__(self, "objective_config", self.objective.build())

    # ------------------------------------------------------------------ rules across sections
    def _check_full(self):
        """finetuning_type full: one error for a key that only means something for LoRA (a LoRA or 4-bit/FP8 key
        set, the merged export) or that needs frozen weights (layer_loop unroll, frozen_weights host given)."""
        if self.lora.finetuning_type != "full":
            return
        lora = [k for k in section_keys("lora") if k.name != "finetuning_type"]
        for k in (BY_NAME["load_in_4bit"], BY_NAME["load_in_fp8"], *lora, BY_NAME["save_merged_model"]):
            if getattr(getattr(self, k.section), k.name) != k.default:
                why = ("the trained model is exported to output_dir/model already" if k.name == "save_merged_model"
                       else "a quantised base cannot be trained" if k.name.startswith("load_in")
                       else "it is a LoRA setting")
                raise TrainConfigError(f"key {k.name!r} is set and finetuning_type is full: {why}; drop {k.name} (or "
                                       "set finetuning_type: lora)", key=k.name)
        explicit = {**self.memory.flat(), **(self.memory.execution or {})}
        for key, value in (("layer_loop", "unroll"), ("frozen_weights", "host"), ("offload_transfer", "explicit")):
            if explicit.get(key) == value:
                raise TrainConfigError(f"key {key!r}: {value!r} needs frozen weights, and finetuning_type full trains "
                                       f"every weight (in the layer scan, on the device); drop {key}", key=key)

    def _check_dpo(self):
        """trainer dpo: one error for a key its completion-only log-probabilities or its adapters-off reference
        cannot honour (loss on prompts, base weights trained beside the adapters, no adapters at all)."""
        if self.objective.trainer != "dpo":
            return
        for key in ("assistant_only_loss", "completion_only_loss"):
            if not getattr(self.data, key):
                raise TrainConfigError(f"key {key!r}: false with trainer dpo, whose log-probabilities are the "
                                       f"completion's (the reply) only; drop {key}", key=key)
        for k in (BY_NAME["modules_to_save"], BY_NAME["trainable_token_indices"], BY_NAME["add_special_tokens"]):
            if getattr(getattr(self, k.section), k.name):
                raise TrainConfigError(f"key {k.name!r} with trainer dpo: the DPO reference is the model with its LoRA "
                                       "adapters off, which cannot undo base weights trained beside them; drop "
                                       f"{k.name}", key=k.name)
        if self.lora.finetuning_type == "full":
            raise TrainConfigError("key 'trainer': dpo with finetuning_type full, which has no adapters to switch off "
                                   "for the DPO reference; set finetuning_type: lora", key="trainer")

    def _full_execution(self, execution: ExecutionConfig) -> ExecutionConfig:
        """`execution`, whose memory preset streams frozen weights from host, with them on the device for a full
        fine-tune (nothing is frozen to stream)."""
        if self.lora.finetuning_type != "full" or execution.frozen_weights != "host":
            return execution
        logger.info("memory: %s streams frozen weights from host; finetuning_type full has none: "
                    "frozen_weights: device", self.memory.memory)
        return execution.replace(frozen_weights="device")

    # ------------------------------------------------------------------ derived values
    def replace(self, **changes) -> "TrainConfig":
        """A copy with `changes` (keys), the others as given (`memory` before gradient_checkpointing chose it)."""
        return TrainConfig(**{**self._given(), **changes})

    def _given(self) -> dict[str, Any]:
        values = {k.name: getattr(getattr(self, k.section), k.name) for k in KEYS}
        return values | self.memory.given()

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, `memory` the mode in force (`from_dict` of it builds this config again,
        quietly): what output_dir/train_config.json holds."""
        out = {k.name: getattr(getattr(self, k.section), k.name) for k in KEYS}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in out.items()}

    def rows_per_step(self, num_devices: int) -> int:
        """Packed rows one optimizer step consumes: per-device batch x accumulation x devices (the devices that
        split batch rows: data x fsdp of the mesh; all of them unless `mesh` has a tensor axis)."""
        return self.data.per_device_train_batch_size * self.optim.gradient_accumulation_steps * num_devices

    def data_config(self, num_devices: int) -> DataConfig:
        """The data pipeline's settings (`jaxft.data.DataConfig`) for a run over `num_devices` devices (the rows
        per step scale with them)."""
        data = self.data
        eval_rows = (data.per_device_eval_batch_size or data.per_device_train_batch_size) * num_devices
        return DataConfig(path=data.dataset, max_seq_length=self.model.max_seq_length,
                          batch_size=self.rows_per_step(num_devices), eval_path=data.eval_dataset,
                          eval_batch_size=eval_rows, seed=self.optim.seed, assistant_only_loss=data.assistant_only_loss,
                          completion_only_loss=data.completion_only_loss, text_field=data.dataset_text_field)

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
        unknown = [key for key in values if ALIASES.get(key, key) not in BY_NAME]
        if unknown:
            raise TrainConfigError(_unknown_keys_message(unknown, source, where))
        kwargs: dict[str, Any] = {}
        spelled: dict[str, Any] = {}  # key -> as written (the key or an alias)
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
        missing = [k.name for k in KEYS if k.required and k.name not in kwargs]
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
                             f"{type_phrase(kind)}")
        if key == "use_peft" and value is False:
            continue  # read as finetuning_type: full (below)
        logger.info("%s: ignored: %s %r: %s", where.get(key, source), key, value, why)
    for key, full in FULL_SWITCHES.items():
        value = values.get(key)
        if key in out:  # (use_peft was taken above)
            value = out.pop(key)
            if not isinstance(value, bool):
                raise error(key, f"value {value!r} ({type(value).__name__}) has the wrong type; expected true/false")
        if value is None or value != full:
            continue
        if out.get("finetuning_type", "full") != "full":
            raise error(key, f"{str(value).lower()} means finetuning_type: full, which contradicts "
                             f"finetuning_type: {out['finetuning_type']}; drop one of the two keys")
        out["finetuning_type"] = "full"
        where.setdefault("finetuning_type", where.get(key, Where(source)))
    return out


def _unknown_keys_message(unknown: list[Any], source: str, where: Mapping[Any, Where]) -> str:
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
        close = closest(key, list(BY_NAME) + list(ALIASES))
        if close:
            notes.append(f"did you mean {close!r}?")
        unhinted |= not close
        items.append(repr(key) + (f" ({'; '.join(notes)})" if notes else ""))
    head = f"unknown key {items[0]}" if len(items) == 1 else f"unknown keys: {', '.join(items)}"
    return f"{prefix}: {head}" + (f"; known keys: {', '.join(BY_NAME)}" if unhinted else "")
