"""The model and logging parts of a run, beside `ExecutionConfig`, `OptimConfig`, `LoraConfig` and `QuantConfig`.

`ModelSource` says which checkpoint is loaded and how (local directory, compute dtype, 4-bit quantisation);
`LoggingConfig` where the outputs go and how often the run logs, evaluates and saves. Each is frozen and
checks its own fields once, when it is built; an error is a `PartError` carrying the field and the problem, so
`TrainConfig` states it under the flat key the user wrote (`MODEL_KEYS`, `LOGGING_KEYS`) without rewriting text.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bridge.errors import hub_id_hint
from jaxft.errors import ConfigError
from jaxft.quant.config import Fp8Config, QuantConfig

DTYPES = ("bfloat16", "float32")
REPORT_TO = ("tensorboard", "none")

# Part field -> flat TrainConfig key. LoggingConfig's fields are the flat keys themselves.
MODEL_KEYS = {"path": "model_name_or_path", "dtype": "bf16", "quant": "load_in_4bit"}
LOGGING_KEYS = {k: k for k in ("output_dir", "logging_steps", "eval_steps", "save_steps", "save_total_limit",
                                "report_to", "disable_tqdm", "eval_generate_prompts",
                                "eval_generate_max_new_tokens", "eval_strategy", "save_strategy")}
STRATEGIES = ("steps", "epoch", "no")  # TrainingArguments' eval_strategy / save_strategy


class PartError(ConfigError):
    """A bad model or logging setting; `field` is the part's field (`MODEL_KEYS` / `LOGGING_KEYS` give the key)."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"key {field!r}: {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The checkpoint a run trains: `path` a local Hugging Face directory (config.json + *.safetensors +
    tokenizer files; nothing is downloaded) or a GGUF file (dequantised on load), `dtype` the compute dtype of the
    frozen weights and activations, `quant` a `jaxft.quant.QuantConfig` to store the frozen linears in 4 bits, or an
    `Fp8Config` for FP8 (None: as stored)."""

    path: str
    dtype: str = "bfloat16"
    quant: Any = None

    def __post_init__(self):
        if not isinstance(self.path, (str, Path)) or not str(self.path).strip():
            raise PartError("path", f"value {self.path!r} is invalid; give a non-empty path")
        path = Path(self.path).expanduser()
        if not path.exists():
            # A Hub id ("meta-llama/Llama-3.2-1B") gets the download command: nothing is fetched here.
            hint = hub_id_hint(str(self.path), repo_type="model")
            raise PartError("path", f"path {str(self.path)!r} does not exist{hint or '; fix the path'}")
        if path.suffix.lower() == ".gguf" and path.is_file():  # a llama.cpp file: config and tokenizer inside
            pass
        elif not (path / "config.json").is_file():
            raise PartError("path", f"{str(self.path)!r} has no config.json; give a local Hugging Face model "
                                    "directory (config.json + *.safetensors + tokenizer files)")
        if self.dtype not in DTYPES:
            raise PartError("dtype", f"value {self.dtype!r} is not one of {', '.join(map(repr, DTYPES))}")
        if self.quant is not None and not isinstance(self.quant, (QuantConfig, Fp8Config)):
            raise PartError("quant", f"value {self.quant!r} must be a jaxft.quant.QuantConfig or Fp8Config (or "
                                     "None: no quantised weights)")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Outputs and their cadence, in optimizer steps: metrics every `logging_steps`, evaluation (the eval set and
    the greedy samples of `eval_generate_prompts`) every `eval_steps` (None: every `logging_steps`), a
    checkpoint every `save_steps`, the newest `save_total_limit` kept (None: all); TensorBoard events unless
    `report_to` is "none"; a progress bar unless `disable_tqdm`."""

    output_dir: str
    logging_steps: int = 10
    eval_steps: int | None = None
    save_steps: int = 500
    save_total_limit: int | None = None
    report_to: str = "tensorboard"
    disable_tqdm: bool = False
    eval_generate_prompts: tuple[str, ...] | None = None
    eval_generate_max_new_tokens: int = 64
    eval_strategy: str = "steps"
    save_strategy: str = "steps"

    def __post_init__(self):
        def need(ok: bool, field: str, what: str):
            if not ok:
                raise PartError(field, f"value {getattr(self, field)!r} is invalid; {what}")

        need(isinstance(self.output_dir, (str, Path)) and bool(str(self.output_dir).strip()), "output_dir",
             "give a non-empty path")
        for field in ("logging_steps", "save_steps", "eval_generate_max_new_tokens"):
            need(_is_int(getattr(self, field)) and getattr(self, field) >= 1, field, "must be an integer >= 1")
        for field in ("eval_steps", "save_total_limit"):
            value = getattr(self, field)
            need(value is None or (_is_int(value) and value >= 1), field, "must be an integer >= 1 (or null)")
        for field in ("eval_strategy", "save_strategy"):
            if getattr(self, field) not in STRATEGIES:
                raise PartError(field, f"value {getattr(self, field)!r} is not one of "
                                       f"{', '.join(map(repr, STRATEGIES))}")
        if self.report_to not in REPORT_TO:
            raise PartError("report_to", f"value {self.report_to!r} is not one of {', '.join(map(repr, REPORT_TO))}")
        need(isinstance(self.disable_tqdm, bool), "disable_tqdm", "must be true or false")
        prompts = self.eval_generate_prompts
        need(prompts is None or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                 and all(isinstance(p, str) and p.strip() for p in prompts)),
             "eval_generate_prompts", "give a non-empty list of non-empty prompt strings (or null)")
        if prompts is not None:
            object.__setattr__(self, "eval_generate_prompts", tuple(prompts))

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
