"""Qwen2-VL and Qwen2.5-VL against transformers (the oracle), on tiny random models built here.

The configs make the vision details bite: several images of different sizes in one flat patch sequence (the
tower must never attend across them), 2.5-VL windows smaller than the images (and images whose block grid is
not a multiple of the window, so edge windows are partial) with one full-attention block among windowed
ones, norm weights and biases drawn away from their init, and M-RoPE sections of unequal width.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import jax
import jax.numpy as jnp

from bridge.mappings import qwen2_vl as vl_table
from bridge.mappings import transforms
from jaxft.models.vision import VisionConfig, VisionTower
from lora_helpers import rel_err

KINDS = ("qwen2_vl", "qwen2_5_vl")
VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=2,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=2,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1]),
}
CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
# (t, h, w) in patches: 2.5-VL windows are 2 x 2 merged tokens, so 6 x 10 patches = 3 x 5 blocks leave
# partial windows at the bottom and right edges. Three images of different sizes through the tower:
# test_logits_match_transformers.
GRIDS = [[(1, 6, 10)], [(1, 6, 10), (1, 4, 4)]]


def _hf_model(kind: str, seed: int = 0):
    config = transformers.AutoConfig.for_model(kind, text_config=TEXT, vision_config=VISION[kind],
                                               image_token_id=IMAGE, video_token_id=VIDEO,
                                               vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[kind])._from_config(config, attn_implementation="eager",
                                                              dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "visual" in name:
                p.normal_(0.0, 0.15)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, 0.3)  # large attention scores: a wrong rotation shows in the logits
    return model.eval()


@pytest.fixture(scope="module", params=KINDS)
def hf(request):
    return request.param, _hf_model(request.param)


def _vision_config(kind: str, model) -> VisionConfig:
    return VisionConfig.from_hf(kind, model.config.to_dict())


def _tower_from_hf(kind: str, model) -> VisionTower:
    """Our tower with the HF tower's weights, through the bridge table's vision rows."""
    cfg = _vision_config(kind, model)
    tower = VisionTower(cfg, dtype=jnp.float32, rngs=None)
    state = {k.replace("model.visual.", "visual."): v.detach().numpy() for k, v in model.state_dict().items()
             if k.startswith("model.visual.")}
    filled = 0
    for row in vl_table.VISION:
        node = tower
        for part in row.path[1:-1]:
            node = getattr(node, part)
        if node is None or getattr(node, row.path[-1], None) is None:
            continue
        parts = [transforms.to_ours(row.transform, state.pop(row.name_at(ix))) for ix in row.indices({"v": cfg.depth})]
        getattr(node, row.path[-1])[...] = jax.device_put(np.stack(parts) if row.axes else parts[0])
        filled += 1
    assert not state, f"HF tensors without a row: {sorted(state)}"
    assert filled > 10
    return tower


def _pixels(grids, seed=0):
    rng = np.random.default_rng(seed)
    n = sum(t * h * w for t, h, w in grids)
    patch = 3 * 2 * 2 * 2
    return rng.normal(0.0, 1.0, (n, patch)).astype(np.float32)


# --------------------------------------------------------------------------- vision tower


def test_vision_tower_equals_transformers_and_attends_inside_each_image(hf):
    kind, model = hf
    tower = _tower_from_hf(kind, model)
    run = jax.jit(lambda p, g: tower(p, g))
    for grids in GRIDS:  # 1 and 2 images of different sizes
        pixels = _pixels(grids)
        thw = np.asarray(grids, np.int64)
        with torch.no_grad():
            want = model.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(thw)).pooler_output.numpy()
        got = np.asarray(run(jnp.asarray(pixels), jnp.asarray(thw, jnp.int32)))
        assert got.shape == want.shape == (len(pixels) // 4, 64)
        assert rel_err(got, want) < 1e-5, grids
    # The tower never attends across images (the same compiled shapes: GRIDS[0] is GRIDS[1]'s first image).
    grids = GRIDS[1]
    pixels = _pixels(grids)
    alone = np.asarray(run(jnp.asarray(pixels[:60]), jnp.asarray(grids[:1], jnp.int32)))
    both = np.asarray(run(jnp.asarray(pixels), jnp.asarray(grids, jnp.int32)))
    # The first image's tokens do not depend on the second image (nor on being packed with it).
    # Rounding only (other matmul shapes, other blockings: ~2e-6 on outputs up to ~2.3 on an AVX-512 CPU); a leak
    # across images would move the outputs by their own size.
    np.testing.assert_allclose(both[:15], alone, rtol=1e-5, atol=1e-5 * float(np.abs(alone).max()))
    changed = pixels.copy()
    changed[60:] += 1.0
    again = np.asarray(run(jnp.asarray(changed), jnp.asarray(grids, jnp.int32)))
    np.testing.assert_array_equal(again[:15], both[:15])
    assert np.abs(again[15:] - both[15:]).max() > 1e-3


# --------------------------------------------------------------------------- M-RoPE positions

def _tokens(grids) -> list[int]:
    m = 2
    return [START] + [IMAGE] * (sum(t * h * w for t, h, w in grids) // (m * m)) + [END]


def _rows(layouts, length, seed=0):
    """Rows of `length` tokens: text runs of random tokens with the images of `layouts` (a list of grids per
    row) between them; returns (ids [B, T], the grids in row-major order)."""
    rng = np.random.default_rng(seed)
    rows, grids = [], []
    for images in layouts:
        row = list(rng.integers(3, 240, 17))
        for grid in images:
            row += _tokens([grid]) + list(rng.integers(3, 240, int(rng.integers(1, 40))))
            grids.append(grid)
        assert len(row) <= length
        rows.append(row + list(rng.integers(3, 240, length - len(row))))
    return np.asarray(rows, np.int64), np.asarray(grids, np.int64).reshape(-1, 3)


LAYOUTS = [[], [(1, 6, 10)], [(1, 8, 6), (1, 2, 2), (1, 6, 10)], [(1, 4, 4), (1, 6, 10)]]


def _hf_positions(model, ids, grids):
    with torch.no_grad():
        pos, _ = model.model.get_rope_index(torch.tensor(ids), mm_token_type_ids=torch.tensor(ids == IMAGE).int(),
                                            image_grid_thw=torch.tensor(grids) if len(grids) else None)
    return pos.numpy()


def test_mrope_positions_equal_get_rope_index(hf):
    from jaxft.models.vision.mrope import mrope_positions

    kind, model = hf
    cfg = _vision_config(kind, model)
    ids, grids = _rows(LAYOUTS, 160)
    got = np.asarray(jax.jit(lambda i, g: mrope_positions(i, g, cfg))(jnp.asarray(ids), jnp.asarray(grids)))
    want = _hf_positions(model, ids, grids)
    np.testing.assert_array_equal(got, want)
    assert (got[1] != got[2]).any() and (got[0] != got[1]).any()  # images really have 3-D positions
    # Packed: two documents in one row (segment ids 1, 2) get the positions each has alone.
    packed = np.concatenate([ids[1], ids[3]])[None]
    seg = np.repeat([[1, 2]], ids.shape[1], axis=1)
    got = np.asarray(jax.jit(lambda i, g, s: mrope_positions(i, g, cfg, s))(jnp.asarray(packed),
                                                                           jnp.asarray(grids[[0, 4, 5]]),
                                                                           jnp.asarray(seg)))
    alone = [_hf_positions(model, ids[1:2], grids[0:1]), _hf_positions(model, ids[3:4], grids[4:6])]
    np.testing.assert_array_equal(got, np.concatenate(alone, axis=2))


# --------------------------------------------------------------------------- the full model

@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory):
    kind, model = hf
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    return kind, model, path


def _processed(sizes, seed=0):
    """pixel_values and image_grid_thw from transformers' image processor for random RGB images of `sizes`."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    processor = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                         size={"shortest_edge": 16, "longest_edge": 4096})
    out = processor(images=images, return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"].astype(np.int64)


def _hf_logits(model, ids, pixels, grids, image_token_id=IMAGE):
    """transformers' logits (the oracle) of rows `ids` with the processor's images (pixels None: text only)."""
    with torch.no_grad():
        kw = {} if pixels is None else dict(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids))
        return model(input_ids=torch.tensor(ids), mm_token_type_ids=torch.tensor(ids == image_token_id).int(),
                     **kw).logits.float().numpy()


def test_logits_match_transformers(saved):
    import jaxft
    from flax import nnx

    kind, hf_model, path = saved
    model = jaxft.from_pretrained(path, dtype="float32")
    # Rows of 600 tokens (>= 512 of text): 1, then 3 images of different sizes, from the processor.
    pixels, grids = _processed([(12, 20), (16, 12), (8, 8), (12, 20)])
    ids, layout_grids = _rows([[tuple(grids[0])], [tuple(g) for g in grids[1:]]], 600)
    np.testing.assert_array_equal(layout_grids, grids)
    run = nnx.jit(lambda m, i, p, g: m(i, pixel_values=p, image_grid_thw=g))
    got = np.asarray(run(model, jnp.asarray(ids), jnp.asarray(pixels), jnp.asarray(grids, jnp.int32)))
    want = _hf_logits(hf_model, ids, pixels, grids)
    assert rel_err(got, want) < 1e-5
    # The images matter: the logits move when one pixel block changes (through the tower) ...
    changed = pixels.copy()
    changed[: grids[0].prod()] += 0.5
    moved = np.asarray(run(model, jnp.asarray(ids), jnp.asarray(changed), jnp.asarray(grids, jnp.int32)))
    assert rel_err(moved, want) > 1e-3
    # ... and text-only rows are the Qwen2 decoder with positions (p, p, p).
    text = ids.copy()
    text[text == IMAGE] = 7
    text_only = np.asarray(nnx.jit(lambda m, i: m(i))(model, jnp.asarray(text)))
    np.testing.assert_allclose(text_only, _hf_logits(hf_model, text, None, None),
                               rtol=2e-4, atol=2e-4 * np.abs(want).max())


# --------------------------------------------------------------------------- import / export

def test_config_round_trips_and_transformers_reads_it(saved):
    import jaxft
    from jaxft.config import ModelConfig

    kind, hf_model, path = saved
    cfg = jaxft.from_pretrained(path, dtype="float32").config
    assert cfg.mrope_section == (2, 3, 3) and cfg.qkv_bias and not cfg.o_bias and cfg.head_dim == 16
    assert cfg.vision.kind == kind and cfg.vision.depth == VISION[kind]["depth"]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    theirs = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert theirs.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    drop = ("transformers_version",)
    assert ({k: v for k, v in theirs.vision_config.to_dict().items() if k not in drop}
            == {k: v for k, v in hf_model.config.vision_config.to_dict().items() if k not in drop})
    # A transformers-4 style config.json (text keys at the top level, rope_scaling type "mrope") reads the same.
    flat = {k: v for k, v in hf_model.config.to_dict().items() if k != "text_config"}
    text = {k: v for k, v in hf_model.config.text_config.to_dict().items() if k not in ("model_type", "rope_parameters")}
    flat.update(text, rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    assert ModelConfig.from_hf(flat) == cfg


def test_round_trip_is_byte_identical(saved, tmp_path):
    import jaxft
    from safetensors.numpy import load_file

    kind, hf_model, path = saved
    out = jaxft.save_pretrained(jaxft.from_pretrained(path, dtype="float32"), tmp_path / "out")
    src, dst = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(src) == sorted(dst) and any(k.startswith("visual.blocks.") for k in src)
    for name in src:
        assert src[name].dtype == dst[name].dtype and src[name].tobytes() == dst[name].tobytes(), name
    # transformers loads the export (its own class, through its conversion of the checkpoint names)
    again = getattr(transformers, CLASSES[kind]).from_pretrained(out, dtype=torch.float32)
    for name, p in hf_model.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name


@pytest.mark.parametrize("hf", ["qwen2_vl"], indirect=True)  # one name table serves both kinds
def test_transformers5_module_names_load(saved, tmp_path):
    """A checkpoint named as transformers 5's modules (model.visual.*, model.language_model.*) loads the same."""
    import jaxft
    from flax import nnx
    from safetensors.numpy import load_file

    kind, hf_model, path = saved
    hf_model.save_pretrained(tmp_path / "v5", save_original_format=False)
    assert any(k.startswith("model.language_model.") for k in load_file(tmp_path / "v5" / "model.safetensors"))
    a = jaxft.from_pretrained(path, dtype="float32")
    b = jaxft.from_pretrained(tmp_path / "v5", dtype="float32")
    ids = jnp.asarray(_rows([[]], 64)[0])
    forward = nnx.jit(lambda m, i: m(i))  # one program for both (op by op, every eager op compiles on its own)
    np.testing.assert_array_equal(np.asarray(forward(a, ids)), np.asarray(forward(b, ids)))
    np.testing.assert_array_equal(np.asarray(a.vision.patch_embed.kernel[...]), np.asarray(b.vision.patch_embed.kernel[...]))


# --------------------------------------------------------------------------- LoRA (language model) and PEFT

def test_vision_and_language_lora_adapter_equals_peft(saved, tmp_path):
    """jaxft's adapter (vision blocks + language layers) in PEFT on transformers' class: equal logits and LoRA
    gradients; and the file loads back into jaxft."""
    import jaxft
    import peft
    from flax import nnx
    from jaxft import lora
    from jaxft.models.vision import finetune_targets
    from lora_helpers import perturb_lora_b

    kind, hf_model, path = saved
    # Unsloth's vision + language selection, plus the merger's two linears (by name).
    targets = rf"(?:{finetune_targets(kind)}|model\.visual\.merger\.mlp\.[02])"
    model = lora.apply_lora(jaxft.from_pretrained(path, dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, target_modules=targets))
    perturb_lora_b(model, seed=4)
    pixels, grids = _processed([(12, 20), (16, 12)])
    ids, _ = _rows([[tuple(grids[0]), tuple(grids[1])]], 520)
    tokens = jnp.asarray(ids)
    graphdef = nnx.graphdef(model)

    @jax.jit
    def logits_and_grads(params, rest):
        """Logits and the LoRA gradients of the next-token loss, one program for every model of this structure."""
        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest)(tokens, pixel_values=jnp.asarray(pixels),
                                                       image_grid_thw=jnp.asarray(grids, jnp.int32))
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), logits

        (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return logits, grads

    def split(m):
        _, params, rest = nnx.split(m, lora.trainable_filter, ...)
        return params, rest

    ours, grad_state = logits_and_grads(*split(model))
    ours = np.asarray(ours)
    lora.save_adapter(model, tmp_path / "adapter")
    base = getattr(transformers, CLASSES[kind]).from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True).eval()
    wrapped = [n for n, _ in theirs.named_modules() if n.endswith("lora_A")]
    per_block = 4 if kind == "qwen2_vl" else 5  # qkv, proj + fc1, fc2 / gate, up, down
    assert sum("visual.blocks" in n for n in wrapped) == per_block * VISION[kind]["depth"]
    assert sum("language_model" in n for n in wrapped) == 7 * TEXT["num_hidden_layers"]
    assert [n for n in wrapped if "merger" in n] == [f"base_model.model.model.visual.merger.mlp.{i}.lora_A"
                                                      for i in (0, 2)]
    want = _hf_logits(theirs, ids, pixels, grids)
    assert rel_err(ours, want) < 1e-5
    assert rel_err(ours, _hf_logits(hf_model, ids, pixels, grids)) > 1e-3  # the adapters change the logits
    # ... and back: the adapter file loads into jaxft with the same logits.
    again = lora.load_adapter(jaxft.from_pretrained(path, dtype="float32"), tmp_path / "adapter")
    assert nnx.graphdef(again) == graphdef  # its static fields (LoRA scale, targets) too: the program applies
    np.testing.assert_allclose(np.asarray(logits_and_grads(*split(again))[0]),
                               ours, rtol=1e-5, atol=1e-6 * np.abs(ours).max())
    # ... and merged into the kernels (the merger's unstacked linears included) it gives them too.
    merged = lora.merge_lora(again)
    assert not merged.vision.merger.fc1.has_lora
    run = nnx.jit(lambda m, i, p, g: m(i, pixel_values=p, image_grid_thw=g))
    np.testing.assert_allclose(np.asarray(run(merged, tokens, jnp.asarray(pixels), jnp.asarray(grids))),
                               ours, rtol=1e-4, atol=1e-5 * np.abs(ours).max())
    # LoRA gradients of the next-token loss equal PEFT's, in a vision block and a language layer.
    grads = {tuple(str(k) for k in key): np.asarray(v[...]) for key, v in nnx.to_flat_state(grad_state)}
    t = torch.tensor(ids)
    out = theirs(input_ids=t, pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                 mm_token_type_ids=(t == IMAGE).int()).logits
    torch.nn.functional.cross_entropy(out[0, :-1], t[0, 1:]).backward()
    modules = dict(theirs.base_model.model.named_modules())
    for path, layer, name in ((("vision", "blocks", "qkv"), 0, "model.visual.blocks.0.attn.qkv"),
                              (("vision", "merger", "fc1"), None, "model.visual.merger.mlp.0"),
                              (("layers", "mlp", "down_proj"), 1, "model.language_model.layers.1.mlp.down_proj")):
        for ours_key, theirs_key in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            want_grad = getattr(modules[name], theirs_key)["default"].weight.grad.numpy()
            got = grads[(*path, ours_key)] if layer is None else grads[(*path, ours_key)][layer]
            assert rel_err(got.T, want_grad) < 1e-4, (name, ours_key)
    # The vision adapters take part: without them (language adapters only) the logits differ.
    for _, lin in nnx.iter_graph(model.vision):
        if isinstance(lin, jaxft.models.Linear) and lin.has_lora:
            lin.lora_b[...] = jnp.zeros_like(lin.lora_b[...])
    assert rel_err(np.asarray(logits_and_grads(*split(model))[0]), want) > 1e-4


def test_finetune_flags_select_the_parts(saved):
    import jaxft
    from jaxft import lora
    from jaxft.config import ConfigError
    from jaxft.models.vision import finetune_targets

    kind, _, path = saved
    model = jaxft.from_pretrained(path, dtype="float32")

    def names(**flags):
        return lora.target_names(model, lora.LoraConfig(target_modules=finetune_targets(kind, **flags)))

    everything = names()
    language = names(finetune_vision_layers=False)
    vision_mlp = names(finetune_language_layers=False, finetune_attention_modules=False)
    assert language and all(n.startswith("model.language_model.layers.") for n in language)
    assert vision_mlp and all(n.startswith("model.visual.blocks.") and ".mlp." in n for n in vision_mlp)
    assert set(language) | set(names(finetune_language_layers=False)) == set(everything)
    assert not any("merger" in n or "lm_head" in n for n in everything)
    with pytest.raises(ConfigError, match="select nothing"):
        finetune_targets(kind, finetune_attention_modules=False, finetune_mlp_modules=False)
    # The merger (left out by Unsloth's finetune_vision_layers, and by all-linear) is adapted when named.
    assert set(lora.target_names(model, lora.LoraConfig())) == set(everything)
    merger = lora.target_names(model, lora.LoraConfig(target_modules=["merger.mlp.0", "merger.mlp.2", "q_proj"]))
    assert [n for n in merger if "merger" in n] == ["model.visual.merger.mlp.0", "model.visual.merger.mlp.2"]


def test_every_parameter_has_exactly_one_row_and_every_row_a_parameter():
    import collections

    from jaxft.config import ModelConfig
    from jaxft.io import param_shapes
    from jaxft.models import FAMILIES, abstract_model

    used = set()
    for kind in KINDS:
        hf = transformers.AutoConfig.for_model(kind, text_config=TEXT, vision_config=VISION[kind],
                                               image_token_id=IMAGE).to_dict()
        paths = set(param_shapes(abstract_model(ModelConfig.from_hf(hf))))
        rows = collections.Counter(row.path for row in FAMILIES[kind].table)
        assert all(rows[p] == 1 for p in paths), [p for p in paths if rows[p] != 1]
        used |= paths
        assert FAMILIES[kind].table is FAMILIES[KINDS[0]].table
    unused = [row.hf for row in FAMILIES[KINDS[0]].table if row.path not in used]
    # Only the shared dense rows Qwen2's decoder has no tensor for (o bias, q/k norm, MLP biases).
    assert set(unused) == {f"model.layers.{{i}}.{m}" for m in (
        "self_attn.o_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.bias",
        "mlp.up_proj.bias", "mlp.down_proj.bias")}


@pytest.mark.parametrize("hf", ["qwen2_vl"], indirect=True)  # the check runs before the tower, for both kinds
def test_image_token_count_mismatch_is_one_clear_error(saved):
    import jaxft

    _, _, path = saved
    model = jaxft.from_pretrained(path, dtype="float32")
    pixels, grids = _processed([(12, 20)])
    ids, _ = _rows([[tuple(grids[0])]], 64)
    ids[0, np.flatnonzero(ids[0] == IMAGE)[0]] = 7  # one image token short
    with pytest.raises(ValueError, match=r"input_ids hold 14 image tokens \(id 250\) but pixel_values give 15") as e:
        model(jnp.asarray(ids), pixel_values=pixels, image_grid_thw=grids)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("hf", ["qwen2_5_vl"], indirect=True)
def test_packed_documents_with_images_equal_each_document_alone(saved):
    """Two documents with images in one row (segment ids 1, 2): attention, M-RoPE and the image embeddings stay
    per document, so each one's logits are transformers' logits of that document alone. One kind: packing is the
    decoder's; Qwen2.5-VL's tower windows over several images: test_vision_tower_equals_transformers_and_attends_
    inside_each_image."""
    import jaxft
    from flax import nnx

    kind, hf_model, path = saved
    model = jaxft.from_pretrained(path, dtype="float32")
    pixels, grids = _processed([(12, 20), (8, 8), (16, 12)])
    first, _ = _rows([[tuple(grids[0])]], 90, seed=1)
    second, _ = _rows([[tuple(grids[1]), tuple(grids[2])]], 110, seed=2)
    packed = np.concatenate([first, second], axis=1)
    seg = np.asarray([[1] * 90 + [2] * 110])
    run = nnx.jit(lambda m, i, s, p, g: m(i, segment_ids=s, pixel_values=p, image_grid_thw=g))  # one compile
    got = np.asarray(run(model, jnp.asarray(packed), jnp.asarray(seg), jnp.asarray(pixels), jnp.asarray(grids)))
    n0 = int(grids[0].prod())
    want = np.concatenate([_hf_logits(hf_model, first, pixels[:n0], grids[:1]),
                           _hf_logits(hf_model, second, pixels[n0:], grids[1:])], axis=1)
    assert rel_err(got, want) < 1e-5
