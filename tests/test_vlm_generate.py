"""Generation with images (Qwen2-VL) against transformers' `generate` (the oracle), and the CLI.

The tiny random Qwen2-VL of tests/test_qwen2_vl.py, fp32. A batch of prompts with images of different sizes
(one prompt of > 512 tokens, one with two images, one text only) is generated in one call and each row must
equal transformers' greedy `generate` of that prompt alone, token for token: the prefill runs the vision
tower and M-RoPE, the decode continues at transformers' `rope_deltas`. The same with a LoRA adapter (B
perturbed) on the vision blocks and the language layers, against PEFT. One kind: the engine's prefill and
decode are the same code for Qwen2.5-VL, whose windowed tower, M-RoPE and vision adapters are held to
transformers and PEFT in tests/test_qwen2_vl.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from lora_helpers import perturb_lora_b
from test_qwen2_vl import CLASSES, IMAGE, _hf_model, _processed, _rows

NEW = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    kind = "qwen2_vl"
    model = _hf_model(kind)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    return kind, model, path


def _prompts():
    """Three prompts: 1 image in 520 tokens, 2 images (of other sizes) in 90, and text only; their images."""
    pixels, grids = _processed([(12, 20), (16, 12), (8, 8)])
    n = [int(g.prod()) for g in grids]
    a, _ = _rows([[tuple(grids[0])]], 520, seed=1)
    b, _ = _rows([[tuple(grids[1]), tuple(grids[2])]], 90, seed=2)
    c, _ = _rows([[]], 30, seed=3)
    images = [(pixels[:n[0]], grids[:1]), (pixels[n[0]:], grids[1:]), None]
    return [a[0].tolist(), b[0].tolist(), c[0].tolist()], images


def _hf_generate(model, ids, images):
    """transformers' greedy continuation (NEW tokens) of one prompt, alone."""
    t = torch.tensor([ids])
    kw = {} if images is None else dict(pixel_values=torch.tensor(images[0]), image_grid_thw=torch.tensor(images[1]))
    with torch.no_grad():
        out = model.generate(input_ids=t, mm_token_type_ids=(t == IMAGE).int(), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW, **kw)
    return out[0, len(ids):].tolist()


def _ours(model, prompts, images):
    from jaxft.generation import PromptImages, generate_ids

    return generate_ids(model, prompts, max_new_tokens=NEW, stop_token_ids=[],
                        images=[None if im is None else PromptImages(*im) for im in images])


@pytest.fixture(scope="module")
def hf_base_continuations(saved):
    """transformers' greedy continuations of the three prompts by the base model (the oracle of the base test; the
    LoRA test's check that the adapter acts)."""
    _, hf_model, _ = saved
    return [_hf_generate(hf_model, ids, im) for ids, im in zip(*_prompts())]


def test_greedy_generation_with_images_equals_transformers(saved, hf_base_continuations):
    import jaxft

    kind, hf_model, path = saved
    prompts, images = _prompts()
    want = hf_base_continuations
    # transformers' decode offsets: the image prompts' rope_deltas are not 0 (so a plain continuation is wrong).
    deltas = [hf_model.model.get_rope_index(torch.tensor([p]), image_grid_thw=torch.tensor(im[1]),
                                            mm_token_type_ids=(torch.tensor([p]) == IMAGE).int())[1].item()
              for p, im in zip(prompts[:2], images[:2])]
    assert all(d < 0 for d in deltas)
    model = jaxft.from_pretrained(path, dtype="float32")
    assert _ours(model, prompts, images) == want


def test_lora_generation_with_images_equals_peft(saved, hf_base_continuations, tmp_path):
    import jaxft
    import peft
    from jaxft import lora
    from jaxft.models.vision import finetune_targets

    kind, hf_model, path = saved
    prompts, images = _prompts()
    model = lora.apply_lora(jaxft.from_pretrained(path, dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, target_modules=finetune_targets(kind)))
    perturb_lora_b(model, seed=5, std=0.3)
    lora.save_adapter(model, tmp_path / "adapter")
    base = getattr(transformers, CLASSES[kind]).from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    want = [_hf_generate(theirs, ids, im) for ids, im in zip(prompts[:2], images[:2])]
    got = _ours(model, prompts[:2], images[:2])
    assert got == want
    assert got != hf_base_continuations[:2]  # the adapter acts


# --------------------------------------------------------------------------- the CLI and the Python API

MODEL = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen2-vl"


def _picture(path, size, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def _messages(*images, text="What is in the picture?"):
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def test_cli_reads_image_parts_relative_to_the_prompts_file(tmp_path, capsys, monkeypatch):
    """`jaxft-generate --file` with image parts equals `generate_ids` on the processor's pixels."""
    from jaxft.data import ImageProcessor, load_tokenizer
    from jaxft.generate_cli import main
    from jaxft.generation import encode_prompt_images, generate_ids

    import jaxft

    (tmp_path / "pics").mkdir()
    _picture(tmp_path / "pics" / "a.png", (70, 90), 0)
    _picture(tmp_path / "pics" / "b.png", (56, 56), 1)
    rows = [{"messages": _messages("pics/a.png")}, {"messages": _messages("pics/b.png", "pics/a.png")},
            {"prompt": "Hello"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.chdir(tmp_path.parent)  # the paths are relative to the file, not the working directory
    assert main([str(MODEL), "--file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "6", "--dtype", "float32",
                 "--json"]) == 0
    got = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    tokenizer, processor = load_tokenizer(MODEL), ImageProcessor.from_model_dir(MODEL)
    model = jaxft.from_pretrained(MODEL, dtype="float32")
    from jaxft.generation import decode_completion, stop_ids

    encoded = [encode_prompt_images(tokenizer, r.get("messages", r.get("prompt")), processor, wrap_strings=True,
                                    base=tmp_path) for r in rows]
    assert [len(e[1].image_grid_thw) if e[1] else 0 for e in encoded] == [1, 2, 0]
    stops = stop_ids(model, tokenizer, model_dir=MODEL)
    out = generate_ids(model, [e[0] for e in encoded], max_new_tokens=6, stop_token_ids=stops,
                       images=[e[1] for e in encoded])
    assert got == [decode_completion(tokenizer, row, stops) for row in out]


def test_image_prompt_errors_are_one_line(tmp_path, capsys):
    from jaxft.generate_cli import main

    _picture(tmp_path / "a.png", (56, 56), 0)
    missing = tmp_path / "m.jsonl"
    missing.write_text(json.dumps({"messages": _messages("a.png", "nowhere.png")}) + "\n", encoding="utf-8")
    assert main([str(MODEL), "--file", str(missing), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{missing} #1: messages[0].content[1]: image {str(tmp_path / 'nowhere.png')!r} " \
        "does not exist; fix the path (relative paths are relative to the prompts file)" in err
    text_only = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"messages": _messages("a.png")}) + "\n", encoding="utf-8")
    assert main([str(text_only), "--file", str(ok), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{ok} #1: the chat has image parts but {text_only} is a text-only model" in err


def test_python_api_errors_name_the_prompt(tmp_path):
    import jaxft
    from jaxft.data import load_tokenizer
    from jaxft.generation import GenerationError, PromptImages, generate_ids

    text_only = jaxft.from_pretrained(MODEL.parent / "tiny-llama", dtype="float32")
    with pytest.raises(GenerationError, match=r"prompts\[0\]: the chat has image parts but the model has no image "
                                              r"processor"):
        jaxft.generate(text_only, load_tokenizer(MODEL.parent / "tiny-llama"), [_messages("a.png")])
    with pytest.raises(GenerationError, match="prompt 0 has images but this llama model has no vision tower"):
        generate_ids(text_only, [[1, 2]], images=[PromptImages(np.zeros((4, 12)), np.asarray([[1, 2, 2]]))])
    vlm = jaxft.from_pretrained(MODEL, dtype="float32")
    image = vlm.config.vision.image_token_id
    pixels = np.zeros((16, vlm.config.vision.patch_dim), np.float32)
    with pytest.raises(GenerationError, match="prompt 0 holds 3 image tokens .* but its images give 4 merged"):
        generate_ids(vlm, [[1, image, image, image]], images=[PromptImages(pixels, np.asarray([[1, 4, 4]]))])
