"""`jaxft-train [CONFIG.yaml] [overrides ...] [--resume [PATH]]`: LoRA fine-tuning from a YAML config, or from
the command line alone as `trl sft` runs (`jaxft-train --model_name_or_path DIR --dataset_name FILE
--output_dir DIR`); TRL's `--config FILE` names the YAML file too.

Keys are those of the keys table, `jaxft.train.keys` (TRL SFTConfig names). Overrides are written the ways
transformers' `HfArgumentParser` (and so TRL's CLI) takes them, mixed freely: `--key value`, `--key=value`,
and jaxft's `key=value`; `--learning-rate` is `--learning_rate`; a bool key written bare (`--bf16`) means
true, `--no_KEY` / `--no-KEY` means false for a bool key that defaults to true. Values are read as YAML
scalars (`--learning_rate 1e-4`, `lora_target_modules=[q_proj,v_proj]`); the value of a bool key also takes
HF's words (yes/no, true/false, t/f, y/n, 1/0). A bad input ends the program with one line on stderr naming
the key / file and the fix, exit status 2, and nothing written to output_dir.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import shlex
import signal
import sys
from pathlib import Path

import jax

import bridge
from jaxft.data.errors import DataError
from jaxft.errors import ConfigError
from jaxft.train import TrainingInterrupted, load_config, train
from jaxft.train.checkpoint import CheckpointError
from jaxft.train.keys import ALIASES, IGNORED_KEYS, KEYS, TrainConfigError
from jaxft.train.config_docs import render_key_help

EXIT_BAD_INPUT = 2
PROG = "jaxft-train"
# HfArgumentParser's `string_to_bool` words.
_TRUE_WORDS = ("yes", "true", "t", "y", "1")
_FALSE_WORDS = ("no", "false", "f", "n", "0")


class UsageError(ValueError):
    """A command line that cannot be split into a config file and overrides."""


def _parser() -> argparse.ArgumentParser:
    """Only for `--help` and the usage line: `_parse` reads the command line itself, because argparse cannot
    take arbitrary `--key value` overrides mixed with `key=value` words."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="LoRA fine-tuning of a Hugging Face causal LM in JAX. Writes checkpoints, metrics.jsonl, "
                    "loss_curve.png and a PEFT adapter (output_dir/adapter) to output_dir.",
        epilog="example: jaxft-train examples/quickstart.yaml --learning_rate 1e-4 --max_steps=200 lora_r=8")
    p.add_argument("config", metavar="CONFIG",
                   help="YAML file of TrainConfig keys (model_name_or_path, dataset, output_dir, ...); also "
                        "--config CONFIG; may be left out when the overrides give every required key")
    p.add_argument("overrides", nargs="*",
                   help="config keys overriding the file's: --key value, --key=value or key=value; a bare bool "
                        "key (--bf16) means true, --no_KEY false")
    p.add_argument("--resume", nargs="?", const="true", default=None, metavar="PATH",
                   help="continue from the latest checkpoint in output_dir (or from PATH); same as "
                        "resume_from_checkpoint=true|PATH")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an input error")
    p.add_argument("--version", action="store_true", help="print the jaxft version and exit")
    return p


def _version() -> str:
    try:
        return importlib.metadata.version("jaxft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package: run `pip install -e .` in the repository)"


def _bool_keys() -> tuple[frozenset[str], frozenset[str]]:
    """The bool keys (bare `--key` means true) and those that default to true (`--no_key` means false): the keys
    HfArgumentParser gives those forms (type bool or bool | None)."""
    bools = {k.name: k for k in KEYS if k.type in (bool, bool | None)}
    true_by_default = {name for name, k in bools.items() if k.default is True}
    true_by_default |= {alias for alias, name in ALIASES.items() if name in true_by_default}
    names = set(bools) | {alias for alias, name in ALIASES.items() if name in bools}
    names |= {key for key, (kind, _) in IGNORED_KEYS.items() if kind is bool}  # TRL's bare --use_peft
    return frozenset(names), frozenset(true_by_default)


def _option_override(word: str, following: list[str], bools: frozenset[str], true_by_default: frozenset[str]
                     ) -> tuple[str, int]:
    """A `--key[=value]` word as a `key=value` override, and how many of the `following` words it used."""
    name, eq, text = word[2:].partition("=")
    key = name.strip().replace("-", "_")
    if not key:
        raise UsageError(f"{word!r}: write an override as --key value, --key=value or key=value")
    if not eq and key.startswith("no_") and key[3:] in true_by_default:
        return f"{key[3:]}=false", 0
    used = 0
    if not eq:
        nxt = following[0] if following else None
        if key in bools:  # bare means true; the next word is its value only when it is one of HF's bool words
            text, used = ("true", 0) if nxt is None or nxt.lower() not in _TRUE_WORDS + _FALSE_WORDS else (nxt, 1)
        elif nxt is None or nxt.startswith("--"):
            raise UsageError(f"{word} needs a value: write {word} VALUE or {word}=VALUE")
        else:
            text, used = nxt, 1
    if key in bools and text.lower() in _TRUE_WORDS + _FALSE_WORDS:
        text = "true" if text.lower() in _TRUE_WORDS else "false"
    return f"{key}={text}", used


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    return TrainConfigError, ConfigError, DataError, CheckpointError, bridge.CheckpointError


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Splits the command line into the config file, `key=value` overrides (every accepted spelling turned
    into that one), `--resume`, `--traceback`, `--help` and `--version`.

    `--resume` takes the next word as its PATH only when that word is a directory (so `--resume key=value`
    and `--resume CONFIG.yaml` mean what they look like); `--resume=PATH` always works. The first word that
    is neither an option nor `key=value` is the config file."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = argparse.Namespace(config=None, overrides=[], resume=None, traceback=False,
                              help=any(w in ("-h", "--help") for w in words), version="--version" in words)
    if args.help or args.version:  # answered before anything else on the line is judged
        return args
    bools: tuple[frozenset[str], frozenset[str]] | None = None
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--traceback":
            args.traceback = True
        elif word == "--resume":
            take = i < len(words) and not words[i].startswith("-") and Path(words[i]).is_dir()
            args.resume = words[i] if take else "true"
            i += int(take)
        elif word.startswith("--resume="):
            args.resume = word.split("=", 1)[1] or "true"
        elif word == "--config" or word.startswith("--config="):  # TRL's spelling of the config file
            path = word.partition("=")[2] if "=" in word else (words[i] if i < len(words) else "")
            i += 0 if "=" in word else 1
            if not path or args.config is not None:
                raise UsageError("--config needs one YAML file: --config FILE (or give FILE as the first word)")
            args.config = path
        elif word.startswith("--"):
            bools = bools or _bool_keys()
            override, used = _option_override(word, words[i:], *bools)
            args.overrides.append(override)
            i += used
        elif word.startswith("-"):
            raise UsageError(f"unknown option {word!r}; overrides are --key value, --key=value or key=value")
        elif args.config is None and ("=" not in word or Path(word).is_file()):
            args.config = word
        elif "=" in word:
            args.overrides.append(word)
        else:
            raise UsageError(f"{word!r} is a second config file or an override without a value; write overrides "
                             "as key=value, --key value or --key=value")
    if args.config is None and not args.overrides:
        raise UsageError("give a YAML config file (CONFIG), e.g. jaxft-train examples/quickstart.yaml, or the keys "
                         "themselves: --model_name_or_path DIR --dataset_name FILE --output_dir DIR")
    return args


def _base_args(base: Path) -> str:
    """from_pretrained's arguments for the base model: a GGUF file is its directory plus gguf_file=."""
    return f"'{base.parent}', gguf_file='{base.name}'" if base.is_file() else f"'{base}'"


def _auto_class(model_dir: Path) -> str:
    """The transformers Auto class that loads the base model: image-text-to-text for a vision-language model."""
    if model_dir.is_file():  # a GGUF file: the text-only families
        return "AutoModelForCausalLM"
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return "AutoModelForImageTextToText" if "vision_config" in config else "AutoModelForCausalLM"


def _resume_command(args) -> str:
    """The command line that continues this run from its latest checkpoint."""
    words = [args.config] if args.config is not None else []
    return " ".join(shlex.quote(w) for w in [PROG, *words, *args.overrides, "--resume"])


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
    except UsageError as e:
        print(_parser().format_usage(), end="", file=sys.stderr)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.help:
        _parser().print_help()
        print()
        print(render_key_help(), end="")
        return 0
    if args.version:
        print(f"jaxft {_version()}")
        return 0
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[jaxft] %(message)s"))
    root = logging.getLogger("jaxft")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    propagate, root.propagate = root.propagate, False  # no second copy through a root handler (absl installs one)
    errors = _bad_input_errors()

    try:
        overrides = list(args.overrides)
        if args.resume is not None:
            overrides.append(f"resume_from_checkpoint={args.resume}")
        config = load_config(args.config, overrides)
        result = train(config)
    except errors as e:
        if args.traceback:
            raise
        print(f"jaxft-train: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingInterrupted as e:
        print(f"{PROG}: {e}; continue with: {_resume_command(args)}", file=sys.stderr)
        return 128 + signal.Signals[e.signal_name].value
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once; checkpoints are atomic, the last one stands
        print(f"{PROG}: interrupted; the last complete checkpoint is kept; continue with: {_resume_command(args)}",
              file=sys.stderr)
        return 128 + signal.SIGINT.value
    finally:
        root.removeHandler(handler)
        root.propagate = propagate


    if jax.process_index() > 0:  # process 0 wrote the outputs and prints where they are
        print(f"process {jax.process_index()} of {jax.process_count()}: trained {result.global_step} steps; process 0 "
              f"wrote the outputs to {result.output_dir}")
        return 0
    base = Path(config.model.model_name_or_path).expanduser().absolute()
    summary = f"trained {result.global_step} steps"
    if result.train_loss is not None:
        summary += f"; train loss {result.train_loss:.4f} (mean of the last logging window)"
    if result.eval_loss is not None:
        summary += f", eval loss {result.eval_loss:.4f}"
    lines = [summary]
    if result.summary is not None:
        lines.append(f"cost:        {result.summary.line()}")
    if result.model_dir is not None:  # finetuning_type full
        lines.append(f"model:       {result.model_dir}")
    else:
        lines.append(f"adapter:     {result.adapter_dir}")
    if result.merged_dir is not None:
        lines.append(f"merged model: {result.merged_dir}")
    if result.gguf_file is not None:
        lines.append(f"gguf:        {result.gguf_file}")
    lines += [f"metrics:     {result.metrics_path}",
              f"loss curve:  {result.loss_curve}" if result.loss_curve else
              "loss curve:  skipped (matplotlib is not installed)",
              f"checkpoints: {result.checkpoint_dir}"]
    if result.model_dir is not None:
        lines.append(f"load in transformers: {_auto_class(base)}.from_pretrained('{result.model_dir}')")
    else:
        lines.append(f"load in PEFT: PeftModel.from_pretrained({_auto_class(base)}.from_pretrained("
                     f"{_base_args(base)}), '{result.adapter_dir}')")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
