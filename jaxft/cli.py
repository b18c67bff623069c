"""`jaxft-train CONFIG.yaml [key=value ...] [--resume [PATH]]`: LoRA fine-tuning from a YAML config.

Keys are `jaxft.train.TrainConfig` fields (TRL SFTConfig names). `key=value` overrides are read as YAML
scalars (`learning_rate=1e-4`, `lora_target_modules=[q_proj,v_proj]`). A bad input ends the program with one
line on stderr naming the key / file and the fix, exit status 2, and nothing written to output_dir.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxft-train",
        description="LoRA fine-tuning of a Hugging Face causal LM in JAX. Writes checkpoints, metrics.jsonl, "
                    "loss_curve.png and a PEFT adapter (output_dir/adapter) to output_dir.",
        epilog="example: jaxft-train examples/quickstart.yaml learning_rate=1e-4 max_steps=200")
    p.add_argument("config", help="YAML file of TrainConfig keys (model_name_or_path, dataset, output_dir, ...)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override a config key")
    p.add_argument("--resume", nargs="?", const="true", default=None, metavar="PATH",  # pre-parsed by _parse
                   help="continue from the latest checkpoint in output_dir (or from PATH); same as "
                        "resume_from_checkpoint=true|PATH")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an input error")
    return p


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    import bridge
    from jaxft.config import ConfigError
    from jaxft.data.errors import DataError
    from jaxft.train.checkpoint import CheckpointError
    from jaxft.train.config import TrainConfigError

    return TrainConfigError, ConfigError, DataError, CheckpointError, bridge.CheckpointError


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse, except that `--resume` takes the next word as its PATH only when that word is a directory
    (so `--resume key=value` and `--resume CONFIG.yaml` mean what they look like). `--resume=PATH` always works."""
    argv = list(sys.argv[1:] if argv is None else argv)
    resume = None
    for i, word in enumerate(argv):
        if word == "--resume":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            take = nxt is not None and not nxt.startswith("-") and Path(nxt).is_dir()
            resume = nxt if take else "true"
            del argv[i:i + 2 if take else i + 1]
            break
        if word.startswith("--resume="):
            resume = word.split("=", 1)[1] or "true"
            del argv[i]
            break
    args = _parser().parse_args(argv)
    args.resume = resume
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[jaxft] %(message)s"))
    root = logging.getLogger("jaxft")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    propagate, root.propagate = root.propagate, False  # no second copy through a root handler (absl installs one)
    errors = _bad_input_errors()
    try:
        from jaxft.train import load_config, train

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
    finally:
        root.removeHandler(handler)
        root.propagate = propagate

    base = Path(config.model_name_or_path).expanduser().absolute()
    summary = f"trained {result.global_step} steps"
    if result.train_loss is not None:
        summary += f"; last step's train loss {result.train_loss:.4f}"
    if result.eval_loss is not None:
        summary += f", eval loss {result.eval_loss:.4f}"
    lines = [summary,
             f"adapter:     {result.adapter_dir}"]
    if result.merged_dir is not None:
        lines.append(f"merged model: {result.merged_dir}")
    lines += [f"metrics:     {result.metrics_path}",
              f"loss curve:  {result.loss_curve}" if result.loss_curve else
              "loss curve:  skipped (matplotlib is not installed)",
              f"checkpoints: {result.checkpoint_dir}",
              f"load in PEFT: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{base}'), "
              f"'{result.adapter_dir}')"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
