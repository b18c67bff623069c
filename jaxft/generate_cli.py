"""`jaxft-generate MODEL_DIR [--adapter DIR] (--prompt TEXT ... | --file prompts.jsonl) [options]`.

Completes prompts with a HF model directory (optionally with a PEFT LoRA adapter, e.g. the output_dir/adapter
that jaxft-train writes). Prompts are wrapped in the tokenizer's chat template unless --no-chat-template.
`--file` is JSONL, one {"prompt": str} or {"messages": [{role, content}, ...]} object per line; with a
vision-language model (Qwen2-VL, Qwen2.5-VL) a message's content may be a list of parts as in the training
data, {"type": "text", "text": ...} and {"type": "image", "image": "path.png"} (paths relative to the file),
run through the model directory's image processor. Output: each
completion under a `### prompt N` header, or one JSON object per line with --json. A bad input ends the program
with one line on stderr naming the file / line / option and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bridge
import jaxft
from jaxft.cli import _bad_input_errors as train_errors
from jaxft.data.formatting import load_tokenizer
from jaxft.data.images import ImageProcessor, image_parts
from jaxft.generation import GenerationError, decode_completion, encode_prompt_images, run_generation, stop_ids

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxft-generate", description="Generate completions with a (LoRA fine-tuned) "
                                "Hugging Face causal LM in JAX, with a KV cache.",
                                epilog="example: jaxft-generate examples/tiny-llama --adapter runs/quickstart/adapter "
                                       "--prompt 'What is 2+2?'")
    p.add_argument("model_dir", help="HF model directory (config.json, *.safetensors, tokenizer files) or a .gguf "
                   "file")
    p.add_argument("--adapter", help="PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--file", help='JSONL file: one {"prompt": str} or {"messages": [...]} per line')
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as plain text")
    p.add_argument("--truncate", action="store_true", help="keep the last tokens of a prompt longer than the "
                   "model's context less --max-new-tokens (default: such a prompt is an error)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--stats", action="store_true", help="print prefill seconds and decode tokens/s to stderr "
                   "(of a second, compiled run; a device sync before each clock read)")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an input error")
    return p


class InputError(ValueError):
    """A bad prompt file or option; the message names the file:line or option and the fix."""


def read_prompts(path: str) -> list:
    """Prompts of a JSONL file: a string per {"prompt": str} line, a chat per {"messages": [...]} line."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--file {path}: no such file; give a JSONL file of {{\"prompt\": ...}} lines")
    out = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg}); write one JSON object per line") from None
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            out.append(record["prompt"])
        elif (isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]
              and all(isinstance(m, dict) for m in record["messages"])):
            out.append(record["messages"])
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise InputError(f"{path}:{n}: expected {{\"prompt\": str}} or {{\"messages\": [{{\"role\", \"content\"}}, "
                             f"...]}}, got {keys}; fix the line")
    if not out:
        raise InputError(f"{path}: no prompts in the file; add {{\"prompt\": ...}} lines")
    return out


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    return (*train_errors(), GenerationError, InputError, bridge.CheckpointError)


def _run(args) -> tuple[list, list[str], dict | None]:
    jaxft.claim_gpu_memory()  # the GPU share jaxft-train takes: a model that trains here also generates here
    prompts = read_prompts(args.file) if args.file else list(args.prompt)
    model_dir = Path(args.model_dir)
    is_gguf = model_dir.suffix.lower() == ".gguf" and model_dir.is_file()  # a llama.cpp file holds it all
    if not is_gguf and not (model_dir / "config.json").is_file():
        raise InputError(f"{model_dir}: not a model directory (no config.json); pass a HF model directory or a "
                         ".gguf file")
    model = jaxft.from_pretrained(model_dir, dtype=args.dtype)
    if args.adapter:
        if not (Path(args.adapter) / "adapter_config.json").is_file():
            raise InputError(f"--adapter {args.adapter}: no adapter_config.json there; pass a PEFT adapter directory "
                             "(jaxft-train writes one to output_dir/adapter)")
        model = jaxft.load_adapter(model, args.adapter)
    tokenizer = load_tokenizer(model_dir)
    where = args.file or "--prompt"
    # The image processor only when a prompt has images (a text-only run needs no preprocessor_config.json).
    with_images = any(not isinstance(p, str) and image_parts(p) for p in prompts)
    processor = ImageProcessor.for_model_dir(model_dir) if with_images else None
    if with_images and processor is None:
        first = next(i for i, p in enumerate(prompts) if not isinstance(p, str) and image_parts(p))
        raise InputError(f"{where} #{first + 1}: the chat has image parts but {model_dir} is a text-only model (no "
                         "vision_config in config.json); use a vision-language model (e.g. Qwen2-VL) or drop the "
                         "image parts")
    base = Path(args.file).parent if args.file else None
    encoded = [encode_prompt_images(tokenizer, p, processor, wrap_strings=not args.no_chat_template,
                                    source=f"{where} #{i + 1}", base=base,
                                    relative_to="the prompts file" if args.file else "the working directory")
               for i, p in enumerate(prompts)]
    ids, images = [e[0] for e in encoded], [e[1] for e in encoded]
    stops = stop_ids(model, tokenizer, model_dir=model_dir)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
              stop_token_ids=stops, images=images if with_images else None, truncate_prompt=args.truncate)
    if args.stats:  # a first, untimed run compiles both programs, so the timed one measures the device work
        run_generation(model, ids, **kw)
    result = run_generation(model, ids, timed=args.stats, **kw)
    texts = [decode_completion(tokenizer, row, stops) for row in result.ids]
    stats = None
    if args.stats:
        stats = dict(prefill_s=result.prefill_s, decode_s=result.decode_s, decode_tokens=result.decode_tokens,
                     decode_tokens_per_s=result.decode_tokens / result.decode_s if result.decode_s else None)
    return prompts, texts, stats


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    errors = _bad_input_errors()
    try:
        prompts, texts, stats = _run(args)
    except errors as e:
        if args.traceback:
            raise
        print(f"jaxft-generate: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if args.json:
            print(json.dumps({"index": i, "prompt": prompt, "completion": text}, ensure_ascii=False))
        else:
            print(f"### prompt {i + 1}\n{text}\n")
    if stats is not None:
        print("jaxft-generate: stats: " + json.dumps(stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
