"""Tests of the training benchmark on the mixture-of-experts and vision-language families (scripts/bench/workloads.py,
the workers, scripts.bench.train): parameter counts, active-expert and vision-tower FLOPs, image rows and their
pixels, the same LoRA targets in jaxft, PEFT and Unsloth; and the jaxft worker's resident-memory report and where
the models are saved.

Oracles: transformers/peft themselves (the released configs and parameter counts on the meta device, PEFT's
targeted modules, the image processor's pixels, transformers' window cut and M-RoPE positions). The CLI end to end
on the tiny MoE (jaxft against HF+PEFT) is test_bench_train.py's pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest

from scripts.bench.workloads import LORA, SHAPES, get_workload, make_token_data, param_counts, useful_flops

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------
# Mixture-of-experts shapes: parameter counts, active-expert FLOPs, the same LoRA in every system.
# ------------------------------------------------------------------------------------------------


def _meta_model(shape):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from scripts.bench.models import build_config

    auto = AutoModelForImageTextToText if shape.is_vlm else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(build_config(shape))


@pytest.mark.parametrize("shape_name, published", [("qwen3-30b-a3b", 30_532_122_624),
                                                    ("gpt-oss-20b", 20_914_757_184)])
def test_moe_shapes_count_every_expert_stored_and_the_top_k_active(shape_name, published):
    """transformers' model on the meta device: stored = attention/lm_head Linears + every expert + routers; active =
    stored less the (E - k) experts a token skips in each sparse layer."""
    from scripts.bench.workloads import moe_layout

    shape = SHAPES[shape_name]
    model = _meta_model(shape)
    assert sum(p.numel() for p in model.parameters()) == published
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and not n.endswith("_bias"))
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", "router.weight")))
    counts, moe = param_counts(shape), moe_layout(shape)
    assert counts["stored_matmul"] == linear + experts + routers
    per_expert = experts // (sum(moe.sparse) * moe.num_experts)
    skipped = sum(moe.sparse) * (moe.num_experts - moe.top_k) * per_expert
    assert counts["frozen_matmul"] == counts["stored_matmul"] - skipped
    from scripts.bench.harness import model_bytes

    assert 0.999 * 2 * published < model_bytes(shape) <= 2 * published


def test_qwen3_30b_a3b_config_is_the_released_one():
    """The fields of Qwen/Qwen3-30B-A3B's config.json as transformers' Qwen3MoeConfig reads them (its defaults differ:
    24 layers, rope_theta 1e4, norm_topk_prob false, head_dim hidden / heads = 64)."""
    from scripts.bench.models import build_config

    cfg = build_config(SHAPES["qwen3-30b-a3b"])
    assert type(cfg).__name__ == "Qwen3MoeConfig"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) == \
        (48, 2048, 128, 8, 768, 32, 4, 128, 151936, True, 1, [])
    assert cfg.rope_parameters["rope_theta"] == 1e6 and not cfg.tie_word_embeddings


def test_useful_flops_counts_the_active_experts():
    """Per token: attention + router + top-8 experts of width 768 (moe_intermediate_size, not the dense
    intermediate_size 6144) + lm_head; LoRA: attention + the top-8 experts' factors."""
    shape = SHAPES["qwen3-30b-a3b"]
    h, e, k, i, r = 2048, 128, 8, 768, LORA.r
    attn = h * 32 * 128 * 2 + h * 4 * 128 * 2
    active = 48 * (attn + h * e + k * 3 * h * i) + h * 151936
    attn_lora = r * ((h + 4096) * 2 + (h + 512) * 2)
    expert_lora = r * (h + 2 * i) + r * (i + h)
    counts = param_counts(shape)
    assert counts["frozen_matmul"] == active
    assert counts["lora_active"] == 48 * (attn_lora + k * expert_lora)
    assert counts["lora"] == 48 * (attn_lora + e * expert_lora)
    t = 4096
    pairs = t * (t + 1) // 2
    expected = t * (4 * active + 6 * 48 * (attn_lora + k * expert_lora)) + 12 * 48 * 32 * 128 * pairs
    assert useful_flops(shape, t, pairs) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("workload", ["tiny_qwen3_moe", "tiny_gpt_oss"])
def test_moe_lora_targets_are_the_same_in_jaxft_peft_and_the_count(workload, tmp_path):
    """jaxft's recipe (with the worker's overrides) and the HF worker's PEFT config adapt the same modules and expert
    parameters, at rank r everywhere; their trainable count is param_counts' "lora"."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from scripts.bench import jaxft_worker
    from scripts.bench.models import build_config, save_random_model
    from scripts.bench.torch_worker import hf_lora_targets
    from jaxft.run import Run

    w = get_workload(workload)
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    run = Run.from_config(jaxft_worker.mode_config("fast", model_dir, w, "float32"), 1)
    ours = set(run.check_targets())
    peft_model = get_peft_model(AutoModelForCausalLM.from_config(build_config(w.shape)), LoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, task_type="CAUSAL_LM", **hf_lora_targets(w)))
    theirs = set(peft_model.base_model.targeted_module_names) | {
        n for n in peft_model.base_model.targeted_parameter_names}
    assert {n.removeprefix("model.") for n in ours} == {n.removeprefix("model.") for n in theirs}
    assert any("experts" in n for n in ours) and not any(n.endswith((".gate_proj", ".up_proj")) for n in ours)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == param_counts(w.shape)["lora"]
    ranks = {tuple(p.shape) for n, p in peft_model.named_parameters() if "experts" in n and "lora_A" in n}
    experts = w.shape.get("num_experts") if w.shape.has("num_experts") else w.shape.get("num_local_experts")
    assert {s[0] for s in ranks} == {LORA.r * experts}  # rank r on gate_up as on down (no 2r fusion)


def test_unsloth_peft_kwargs_train_the_same_parameters():
    """Built without running Unsloth (it needs a GPU): the MoE experts through target_parameters, attention linears
    only as modules; a VLM's language layers only; dense shapes as before."""
    from scripts.bench.torch_worker import unsloth_peft_kwargs

    moe = unsloth_peft_kwargs(get_workload("qwen3_30b_a3b_4096"))
    assert moe["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert moe["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert moe["r"] == LORA.r and moe["lora_alpha"] == LORA.alpha and moe["max_seq_length"] == 4096
    vlm = unsloth_peft_kwargs(get_workload("qwen2_5_vl_7b_448"))
    assert (vlm["finetune_vision_layers"], vlm["finetune_language_layers"], vlm["finetune_attention_modules"],
            vlm["finetune_mlp_modules"]) == (False, True, True, True)
    assert "target_modules" not in vlm and "target_parameters" not in vlm
    dense = unsloth_peft_kwargs(get_workload("8b_4096"))
    assert dense["target_modules"] == list(LORA.targets) and "target_parameters" not in dense


# ------------------------------------------------------------------------------------------------
# Vision-language shapes: the tower's counts, image rows, the same pixels and LoRA everywhere.
# ------------------------------------------------------------------------------------------------


def test_qwen2_5_vl_7b_shape_matches_transformers():
    from scripts.bench.models import build_config
    from scripts.bench.workloads import vision_params

    shape = SHAPES["qwen2.5-vl-7b"]
    cfg = build_config(shape)
    text, vision = cfg.text_config, cfg.vision_config
    assert type(cfg).__name__ == "Qwen2_5_VLConfig"
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.vocab_size, text.rope_parameters["mrope_section"]) == \
        (3584, 18944, 28, 28, 4, 152064, [16, 24, 24])
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.out_hidden_size,
            vision.window_size, list(vision.fullatt_block_indexes), vision.patch_size, vision.spatial_merge_size,
            vision.temporal_patch_size) == (32, 1280, 3420, 16, 3584, 112, [7, 15, 23, 31], 14, 2, 2)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (151655, 151652, 151653)
    model = _meta_model(shape)
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656
    named = dict(model.named_modules())
    lang = sum(m.weight.numel() for n, m in named.items() if isinstance(m, torch.nn.Linear) and "visual" not in n)
    assert param_counts(shape)["frozen_matmul"] == lang
    blocks = sum(m.weight.numel() for n, m in named.items() if isinstance(m, torch.nn.Linear) and ".blocks." in n)
    merger = sum(m.weight.numel() for n, m in named.items() if isinstance(m, torch.nn.Linear) and ".merger." in n)
    v = vision_params(shape)
    assert v["per_patch"] == named["model.visual.patch_embed.proj"].weight.numel() + blocks
    assert v["per_merged"] == merger


def test_vision_attention_pairs_follow_transformers_windows():
    """Window pairs against transformers' own window cut (get_vision_window_index's cumulative window lengths)."""
    from transformers.vision_utils import get_vision_window_index

    from scripts.bench.workloads import vision_attention_pairs

    for name, grid in (("tiny-qwen2.5-vl", (1, 10, 10)), ("tiny-qwen2.5-vl", (1, 8, 12)),
                       ("qwen2.5-vl-7b", (1, 32, 32)), ("qwen2.5-vl-7b", (1, 74, 74))):
        v = SHAPES[name].get("vision_config")
        _, cu = get_vision_window_index(torch.tensor([grid]), spatial_merge_size=2, window_size=v["window_size"],
                                        patch_size=14)
        lengths = torch.diff(torch.unique_consecutive(torch.as_tensor(cu)))
        got = vision_attention_pairs(SHAPES[name], grid)
        assert got["window"] == int((lengths ** 2).sum()) and got["full"] == (grid[1] * grid[2]) ** 2


def test_image_rows_hold_the_processors_pixels_and_mask_image_targets(tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor

    from scripts.bench.models import save_processor_config
    from scripts.bench.workloads import IMAGE_TEXT_PREFIX, synthetic_image

    w = get_workload("tiny_qwen2_5_vl")
    d = make_token_data(w, 2)
    assert d.sha256 == make_token_data(w, 2).sha256
    image_id, start = w.shape.get("image_token_id"), w.shape.get("vision_start_token_id")
    grid = d.image_grids(0)[0]
    n = grid[0] * grid[1] * grid[2] // 4  # tokens = patches / merge^2
    row = d.input_ids[0, 0]
    assert grid == (1, 10, 10) and row[IMAGE_TEXT_PREFIX] == start
    assert np.flatnonzero(row == image_id).tolist() == list(range(IMAGE_TEXT_PREFIX + 1, IMAGE_TEXT_PREFIX + 1 + n))
    assert row[IMAGE_TEXT_PREFIX + 1 + n] == w.shape.get("vision_end_token_id")
    text = np.delete(row, range(IMAGE_TEXT_PREFIX, IMAGE_TEXT_PREFIX + n + 2))
    assert (text < 508).all()  # no vision special id drawn into the text
    # A target that is an image token carries no loss; in HF's labels those positions are -100.
    assert np.array_equal(d.loss_mask[..., :-1] == 0, d.input_ids[..., 1:] == image_id)
    assert np.array_equal(d.hf_labels() == -100, (d.input_ids == image_id) | (d.positions == 0))
    # The pixels are what the image processor the model directory names gives for the seeded image.
    save_processor_config(w.shape, str(tmp_path))
    proc = AutoImageProcessor.from_pretrained(str(tmp_path))
    rng = np.random.Generator(np.random.PCG64(w.seed + 1))
    out = proc(images=[Image.fromarray(synthetic_image(rng, w.image_size))], return_tensors="np")
    pixels, grids = d.hf_images(0)
    np.testing.assert_array_equal(pixels, out["pixel_values"])
    np.testing.assert_array_equal(grids, out["image_grid_thw"])
    assert d.step(1)["pixel_values"].shape == (1, 100 * 1176) and d.step(1)["image_grid_thw"].tolist() == [[1, 10, 10]]
    # The data hash covers the pixels: other pixels, other hash.
    import dataclasses

    other = dataclasses.replace(d, pixel_values=d.pixel_values + 1.0)
    assert other.sha256 != d.sha256
    # What the report says of a VLM row: its image tokens per step, and the note on text + image tokens.
    from scripts.bench.train import workload_notes

    assert d.stats()["image_tokens_per_step"] == 25
    assert any("text + image tokens" in n for n in workload_notes(["tiny_qwen2_5_vl"]))
    assert not any("text + image tokens" in n for n in workload_notes(["tiny_qwen3_moe"]))


def test_vlm_useful_flops_add_the_tower_forward():
    from scripts.bench.workloads import vision_attention_pairs, vision_params

    shape = SHAPES["qwen2.5-vl-7b"]
    grid = (1, 32, 32)  # 448 px
    text = useful_flops(shape, 4096, 4096 * 4097 // 2)
    vp, pairs = vision_params(shape), vision_attention_pairs(shape, grid)
    tower = 2 * (vp["per_patch"] * 1024 + vp["per_merged"] * 256) + 4 * 80 * 16 * (4 * pairs["full"]
                                                                                   + 28 * pairs["window"])
    assert useful_flops(shape, 4096, 4096 * 4097 // 2, image_grids=[grid]) == pytest.approx(text + tower, rel=1e-12)


def test_vlm_lora_targets_are_the_language_layers_in_jaxft_and_peft(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from scripts.bench import jaxft_worker
    from scripts.bench.models import build_config, save_random_model
    from scripts.bench.torch_worker import hf_lora_targets
    from jaxft.run import Run

    w = get_workload("tiny_qwen2_5_vl")
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    assert (tmp_path / "m" / "preprocessor_config.json").exists()
    ours = Run.from_config(jaxft_worker.mode_config("fast", model_dir, w, "float32"), 1).check_targets()
    peft_model = get_peft_model(AutoModelForImageTextToText.from_config(build_config(w.shape)), LoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, task_type="CAUSAL_LM", **hf_lora_targets(w)))
    theirs = peft_model.base_model.targeted_module_names
    assert sorted(ours) == sorted(theirs) and len(theirs) == 2 * 7
    assert not any("visual" in n for n in theirs)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == param_counts(w.shape)["lora"]


def test_qlora_mode_trains_the_moe_shape_with_4bit_experts(tmp_path):
    """The jaxft_qlora system on the tiny Qwen3-MoE (the plumbing of its qwen3_30b_a3b_4096 run): the recipe
    loads in 4 bits with expert LoRA, the experts are stored 4-bit (their codes alone are half a byte per
    weight: more than every 4-bit linear together here) and it trains."""
    from scripts.bench import jaxft_worker
    from scripts.bench.models import save_random_model
    from scripts.bench.workloads import moe_layout

    w = get_workload("tiny_qwen3_moe")
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    config = jaxft_worker.mode_config("qlora", model_dir, w, "float32")
    assert config.quant_config is not None and config.lora_config.target_parameters
    raw = jaxft_worker.run_jaxft(w, model_dir, 2, mode="qlora")
    assert len(raw["losses"]) == 2 and all(np.isfinite(raw["losses"]))
    # The row says which grouped matmul ran: the recipe's "auto" is ragged_dot off the GPU.
    assert (raw["settings"]["grouped_matmul_setting"], raw["settings"]["grouped_matmul"]) == ("auto", "xla")
    moe = moe_layout(w.shape)
    experts = sum(moe.sparse) * moe.num_experts * 3 * w.shape.get("hidden_size") * moe.width
    mem = raw["extra"]["memory_bytes"]
    assert mem["frozen_quantized_weights"] >= experts // 2
    assert mem["frozen_weights"] < 4 * experts  # all frozen weights < the experts alone in float32


def test_moe_rows_record_the_grouped_matmul_and_jaxft_bench_gmm_chooses_it(tmp_path, monkeypatch):
    """JAXFT_BENCH_GMM sets the recipe's grouped_matmul_implementation (the A/B switch); a MoE row's settings name
    the implementation that ran, a dense row's none."""
    from scripts.bench import jaxft_worker
    from scripts.bench.models import save_random_model

    w = get_workload("tiny_qwen3_moe")
    model_dir = str(tmp_path / "m")
    save_random_model(w.shape, model_dir, "cpu")
    monkeypatch.setenv("JAXFT_BENCH_GMM", "reference")
    execution = jaxft_worker.mode_config("fast", model_dir, w, "float32").execution_config
    assert execution.grouped_matmul_implementation == "reference"
    assert jaxft_worker.grouped_matmul_settings(w, execution, "bfloat16") == {
        "grouped_matmul_setting": "reference", "grouped_matmul": "reference"}
    auto = execution.replace(grouped_matmul_implementation="auto")
    assert jaxft_worker.grouped_matmul_settings(w, auto, "float32")["grouped_matmul"] == "xla"  # CPU
    assert jaxft_worker.grouped_matmul_settings(get_workload("tiny_llama"), auto, "float32") == {}


def test_hf_attention_is_what_transformers_accepts_for_each_family(tmp_path):
    """SDPA unless transformers refuses it: eager for Gemma 2's soft-capping; GPT-OSS's sinks have no SDPA path,
    flex attention on a GPU and eager on the CPU (transformers refuses sinks in flex attention there). Before,
    the worker asked for SDPA and HF+PEFT could not load GPT-OSS at all (found on a tiny model, CPU)."""
    import transformers

    from scripts.bench.models import build_config
    from scripts.bench.torch_worker import hf_attention

    configs = {name: build_config(SHAPES[name]).to_dict() for name in ("tiny-gpt-oss", "tiny-gemma2", "tiny-llama")}
    assert hf_attention(configs["tiny-llama"], "cuda") == "sdpa"
    assert hf_attention(configs["tiny-gemma2"], "cuda") == hf_attention(configs["tiny-gemma2"], "cpu") == "eager"
    assert (hf_attention(configs["tiny-gpt-oss"], "cuda"), hf_attention(configs["tiny-gpt-oss"], "cpu")) == (
        "flex_attention", "eager")
    with pytest.raises(ValueError, match="does not support an attention implementation through"):
        transformers.AutoModelForCausalLM.from_config(build_config(SHAPES["tiny-gpt-oss"]), attn_implementation="sdpa")


def test_hf_vlm_steps_take_the_m_rope_positions_jaxft_computes(tmp_path):
    """The torch side's vision inputs (`TokenData.hf_vision_inputs`) make transformers compute M-RoPE positions
    equal to jaxft's `mrope_positions` for the same row (text after an image advances by max(h, w) merged
    patches, not by the image's token count), and `train_loop` refuses a VLM step that computed none: without
    mm_token_type_ids transformers 5 silently trains on 1-D positions (as the first 7B rows did; experiments/LOG.md)."""
    import dataclasses

    import jax.numpy as jnp
    from transformers import AutoModelForImageTextToText

    from scripts.bench.models import build_config
    from scripts.bench.torch_worker import train_loop
    from jaxft.vision_config import VisionConfig
    from jaxft.models.vision.mrope import mrope_positions

    w = get_workload("tiny_qwen2_5_vl")
    d = make_token_data(w, 2)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(build_config(w.shape))
    inputs = d.hf_vision_inputs(0)
    assert set(inputs) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert inputs["mm_token_type_ids"].sum() == (d.input_ids[0] == w.shape.get("image_token_id")).sum() == 25
    theirs, _ = model.model.get_rope_index(torch.from_numpy(d.input_ids[0].astype(np.int64)),
                                           mm_token_type_ids=torch.from_numpy(inputs["mm_token_type_ids"]),
                                           image_grid_thw=torch.from_numpy(inputs["image_grid_thw"]))
    cfg = VisionConfig.from_hf("qwen2_5_vl", build_config(w.shape).to_dict())
    ours = mrope_positions(jnp.asarray(d.input_ids[0]), jnp.asarray(inputs["image_grid_thw"]), cfg)
    np.testing.assert_array_equal(theirs.numpy(), np.asarray(ours))
    t = d.input_ids.shape[-1]
    assert int(theirs[0, 0, -1]) == t - 1 - 25 + 5  # 25 image tokens advance the text by 5 (a 5 x 5 merged grid)

    out = train_loop(model, w, d, 1, "cpu")
    assert np.isfinite(out["losses"][0])

    class OneDimensional(type(d)):  # what the bench passed before: no mm_token_type_ids
        def hf_vision_inputs(self, i):
            return {k: v for k, v in super().hf_vision_inputs(i).items() if k != "mm_token_type_ids"}

    with pytest.raises(RuntimeError, match=r"tiny_qwen2_5_vl: the model computed no M-RoPE positions .*"
                                           r"pass mm_token_type_ids"):
        train_loop(model, w, OneDimensional(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}), 1, "cpu")


def test_resident_outside_names_the_arrays_beside_the_state_and_the_allocator_difference():
    import jax.numpy as jnp

    from scripts.bench import jaxft_worker

    state = {"w": jnp.ones((64, 64), jnp.float32)}
    stray = jnp.zeros((128, 128), jnp.bfloat16)  # alive beside the state, as a leftover of a load would be

    class Device:  # the GPU's allocator statistics, which the CPU backend does not report
        def memory_stats(self):
            return {"bytes_in_use": 64 * 64 * 4 + stray.nbytes + 1000}

    found = jaxft_worker.resident_outside(state, Device())
    assert [128, 128] in [shape for shape, _, _ in found["largest"]] and found["bytes"] >= stray.nbytes
    assert found["state_bytes"] == 64 * 64 * 4
    assert found["in_use_beyond_state"] == found["in_use_beyond_state_after_gc"] == stray.nbytes + 1000


def test_models_go_to_shm_only_when_the_host_ram_holds_them_and_the_saving_worker():
    """The two MoE shapes of the benchmark together passed /dev/shm's free-space check on the 128 GiB H200 host,
    and the save was killed for memory: /dev/shm is RAM, and the saving worker holds the model it writes."""
    from scripts.bench.harness import model_bytes, models_place

    gib = 2 ** 30
    qwen, gpt_oss = model_bytes(SHAPES["qwen3-30b-a3b"]), model_bytes(SHAPES["gpt-oss-20b"])
    assert 55 * gib < qwen < 60 * gib and 37 * gib < gpt_oss < 41 * gib  # bf16, every expert stored
    host = dict(shm_free=128 * gib, ram_available=125 * gib)  # the H200 host's /dev/shm and RAM, about
    assert models_place([qwen], disk_free=60 * gib, **host) == "shm"  # it ran so
    assert models_place([gpt_oss], disk_free=60 * gib, **host) == "shm"
    assert models_place([qwen, gpt_oss], disk_free=200 * gib, **host) == "disk"
    why = models_place([qwen, gpt_oss], disk_free=60 * gib, **host)
    assert why.startswith("the models need 9") and "one TRAIN_PLAN pass per shape" in why and "\n" not in why
    assert models_place([qwen], shm_free=50 * gib, ram_available=125 * gib, disk_free=100 * gib) == "disk"
