"""Mixed 4-bit layouts (Unsloth's dynamic 4-bit checkpoints): a linear 4-bit in some layers and dense in others,
against transformers + bitsandbytes on CPU (the oracle) on a tiny random Llama of 4 layers whose skip list names
single layers' modules (down_proj dense in layers 1-2, a run of two; q_proj dense in layer 3). The checkpoint loads
with its bytes and its logits in both layer loops, writes back the same layout, QLoRA trains on it and resumes, its
PEFT adapter loads onto it in transformers, its frozen weights stream from host memory (`frozen_weights: host`) with
the gradients of the on-device layout, greedy generation matches, and jaxft's own dynamic quantiser decides per
layer.

The oracle's logits: the bitsandbytes model with each `Linear4bit` replaced by its weight dequantised by
bitsandbytes, in float32 (bitsandbytes' fused CPU kernel computes the 4-bit matmul in bfloat16 on CPUs with
AVX512-BF16, tests/bnb_helpers.py, which would hide a 1e-4 difference). Tolerance: 1e-4 of the max logit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("bitsandbytes")
import bitsandbytes as bnb  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

from flax import nnx  # noqa: E402

import jaxft  # noqa: E402
from jaxft.generation.engine import generate_ids  # noqa: E402
from jaxft.models.build import model_class  # noqa: E402
from jaxft.models.stack import streamed_weight  # noqa: E402
from jaxft.quant import QuantConfig  # noqa: E402
from jaxft.memory.execution import ExecutionConfig  # noqa: E402
from jaxft.memory.scan_offload import in_host_memory, is_slot  # noqa: E402
from jaxft.memory.streamed import pack, unpack  # noqa: E402
from jaxft.quant.weights import abstract_quantize, layer_saving, saved_bytes  # noqa: E402
from jaxft.train import TrainConfig, read_metrics, split_model, train, unstack_layers  # noqa: E402
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches  # noqa: E402
from bnb_helpers import cpu_4bit_logit_tol, save_tiny_llama  # noqa: E402
from lora_helpers import jax_logits, perturb_lora_b, rel_err, torch_logits  # noqa: E402
from test_remat import assert_grads_match, packed_batch  # noqa: E402
from test_train_fixtures import make_jsonl, make_tokenizer  # noqa: E402

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SKIP = ["lm_head", "model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj", "model.layers.3.self_attn.q_proj"]
TOL = 1e-4


def _bnb_config(skip):
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                           bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip)


def _hf_load(path):
    """A 4-bit directory as transformers loads it (its own quantization_config)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _dequantized(model):
    """`model` with each bitsandbytes `Linear4bit` replaced by an nn.Linear of its weight as bitsandbytes
    dequantises it (float32), in place."""
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state).float()
                setattr(parent, name, dense)
    return model.eval()


def _tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path / "model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _skip_list(path: Path) -> list[str]:
    return json.loads((path / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base"), BASE)


@pytest.fixture(scope="module")
def mixed_dir(base, tmp_path_factory):
    """The base quantised by transformers + bitsandbytes (NF4, double quant) with a per-layer skip list."""
    path = tmp_path_factory.mktemp("mixed")
    transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=_bnb_config(SKIP), device_map="cpu",
                                                      dtype=torch.float32).save_pretrained(path)
    make_tokenizer().save_pretrained(path)  # for the training run
    return path


@pytest.fixture(scope="module")
def oracle(mixed_dir):
    return _dequantized(_hf_load(mixed_dir))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, (1, 96)).astype(np.int32)


@pytest.fixture(scope="module")
def model(mixed_dir):
    return jaxft.from_pretrained(mixed_dir, dtype="float32")


def test_mixed_checkpoint_loads_its_bytes_and_logits_in_both_loops(model, mixed_dir, oracle, ids):
    files = _tensors(mixed_dir)
    down, q = model.layers.mlp.down_proj, model.layers.attn.q_proj
    assert down.quant_rows == (True, False, False, True) and q.quant_rows == (True, True, True, False)
    assert model.layers.mlp.up_proj.quant_rows is None and model.layers.mlp.up_proj.kernel is None
    # The 4-bit rows are the stored codes; the dense rows the stored weights (ours [in, out], torch's [out, in]).
    for row, layer in enumerate((0, 3)):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert np.array_equal(np.asarray(down.quant.packed[...][row]), files[name][:, 0])
        assert np.array_equal(np.asarray(down.quant.absmax[...][row]), files[name + ".absmax"])
    for row, layer in enumerate((1, 2)):
        assert np.array_equal(np.asarray(down.kernel[...][row]).T, files[f"model.layers.{layer}.mlp.down_proj.weight"])
    assert np.array_equal(np.asarray(q.kernel[...][0]).T, files["model.layers.3.self_attn.q_proj.weight"])
    ref, got = torch_logits(oracle, ids), jax_logits(model, ids)
    assert rel_err(got, ref) < TOL  # the layer scan: runs of one layout
    unrolled = jaxft.apply_lora(jaxft.from_pretrained(mixed_dir, dtype="float32"), jaxft.LoraConfig(r=4, alpha=8))
    graphdef, lora, frozen = split_model(unrolled)
    assert rel_err(jax_logits(nnx.merge(graphdef, lora, unstack_layers(frozen)), ids), ref) < TOL
    # ... and the checkpoint as transformers runs it, 4-bit matmuls and all (bitsandbytes' CPU kernel's tolerance)
    assert rel_err(got, torch_logits(_hf_load(mixed_dir), ids)) < cpu_4bit_logit_tol(1e-5)
    with pytest.raises(ValueError, match="already bitsandbytes 4-bit"):
        jaxft.from_pretrained(mixed_dir, dtype="float32", quantize="nf4")


def test_the_abstract_model_has_the_loaded_shapes(model, mixed_dir):
    """What `jaxft.run.Run` compiles before the weights are read (`abstract_quantize`) is the loaded layout."""
    def build():
        fresh = model_class(model.config)(model.config, dtype=jnp.float32, rngs=nnx.Rngs(0))
        abstract_quantize(fresh, mixed_dir, None)
        return fresh

    def shapes(m):
        return {p: (type(v).__name__, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(m))}

    abstract = nnx.eval_shape(build)
    assert shapes(abstract) == shapes(model)
    assert abstract.layers.mlp.down_proj.quant_rows == model.layers.mlp.down_proj.quant_rows


def test_save_quantized_writes_the_same_layout(model, mixed_dir, tmp_path):
    jaxft.save_pretrained(model, tmp_path / "q", quantized=True)
    assert sorted(_skip_list(tmp_path / "q")) == sorted(_skip_list(mixed_dir))
    written, stored = _tensors(tmp_path / "q"), _tensors(mixed_dir)
    assert sorted(written) == sorted(stored)
    for name, value in stored.items():
        assert written[name].dtype == value.dtype and np.array_equal(written[name], value), name
    hf = _hf_load(tmp_path / "q")
    assert type(hf.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert isinstance(hf.model.layers[3].mlp.down_proj, bnb.nn.Linear4bit)


def test_peft_adapter_loads_onto_the_mixed_checkpoint(mixed_dir, oracle, ids, tmp_path):
    tuned = jaxft.apply_lora(jaxft.from_pretrained(mixed_dir, dtype="float32"), jaxft.LoraConfig(r=4, alpha=8))
    perturb_lora_b(tuned)
    jaxft.save_adapter(tuned, tmp_path / "adapter")
    hf = peft.PeftModel.from_pretrained(_dequantized(_hf_load(mixed_dir)), tmp_path / "adapter").eval()
    ours, ref = jax_logits(tuned, ids), torch_logits(hf, ids)
    assert rel_err(ours, torch_logits(oracle, ids)) > 1e-2  # the adapter changes the logits
    assert rel_err(ours, ref) < TOL
    # The merged export is dense: every layer dequantised or as stored, plus its adapter.
    jaxft.save_pretrained(tuned, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    assert rel_err(torch_logits(merged, ids), ours) < TOL


def test_qlora_trains_on_the_mixed_checkpoint_and_resumes(mixed_dir, tmp_path):
    data = make_jsonl(tmp_path / "data.jsonl", 16)
    config = dict(model_name_or_path=str(mixed_dir), dataset=str(data), output_dir=str(tmp_path / "run"), bf16=False,
                  max_seq_length=32, per_device_train_batch_size=2, max_steps=1, save_steps=1, logging_steps=1,
                  report_to="none", disable_tqdm=True, lora_r=4, lora_alpha=8, seed=0)
    # the layer scan (runs of one layout), every layer checkpointed; both runs take the one step program (the
    # unrolled loop's mixed layout: test_mixed_checkpoint_loads_its_bytes_and_logits_in_both_loops), the same for
    # 1 and 2 steps at a constant rate
    config.update(layer_loop="scan", remat="full", lr_scheduler_type="constant")
    first = train(TrainConfig(**config))
    again = train(TrainConfig(**{**config, "max_steps": 2, "resume_from_checkpoint": True}))
    rows = [r for r in read_metrics(again.metrics_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert first.metrics_path == again.metrics_path
    tuned = jaxft.load_adapter(jaxft.from_pretrained(mixed_dir, dtype="float32"), tmp_path / "run" / "adapter")
    assert np.abs(np.asarray(tuned.layers.mlp.down_proj.lora_b[...])).max() > 0  # trained


def test_frozen_weights_on_the_host_and_unrolled_layers_give_the_gradients_of_weights_on_the_device(mixed_dir):
    """`frozen_weights: host` over the mixed layout, packed as `jaxft.run.Run` places it: the scan runs of one
    layout stream the packed buffers' rows and each mixed variable's own rows (an array of its own in pinned host
    memory, `jaxft.memory.streamed.pack`); on the CPU the copies are identities, so loss and LoRA gradients equal
    those over the weights on the device (remat offload: the layer input to the host too), and so do the unrolled
    layers' (the explicit transfer over 4-bit layers). Streamed per-leaf arrays, and a Run's packed weights training
    to the losses on the device: test_frozen_weights_host."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    tuned = jaxft.apply_lora(jaxft.from_pretrained(mixed_dir, dtype="float32"), jaxft.LoraConfig(r=4, alpha=8))
    perturb_lora_b(tuned)  # B = 0 would make every A gradient zero
    graphdef, lora, frozen = split_model(tuned)
    streamed = pack(frozen, host)
    flat = nnx.to_flat_state(streamed)
    apart = {p: v.get_value() for p, v in flat if streamed_weight(p, v) and not is_slot(v.get_value())}
    # the mixed linears' entries (q_proj dense in layer 3 only, down_proj in layers 1-2) stay unpacked, each in
    # pinned host memory with its own rows; the rest is packed
    assert {p[:3] for p in apart} == {("layers", "attn", "q_proj"), ("layers", "mlp", "down_proj")}
    assert all(in_host_memory(v) for v in apart.values())
    assert apart[("layers", "mlp", "down_proj", "kernel")].shape[0] == 2
    assert apart[("layers", "attn", "q_proj", "quant", "packed")].shape[0] == 3
    assert is_slot(dict(flat)[("layers", "mlp", "up_proj", "quant", "packed")].get_value())
    # the 4-bit codes and scales stream packed per dtype (uint8 codes and absmax codes, float32 nested scales)
    assert {v.get_value().key[1] for p, v in flat if is_slot(v.get_value()) and "quant" in p} >= {"uint8", "float32"}
    want = dict(nnx.to_flat_state(frozen))
    for p, v in nnx.to_flat_state(unpack(streamed)):
        if v.get_value() is not None:
            np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(want[p].get_value()))
    batch = stack_micro_batches(packed_batch(VOCAB), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat="offload", layer_loop="scan")
    step = jax.jit(lambda lo, fz: loss_and_grad_sums(graphdef, lo, fz, batch, None, ex)[:2])
    loss, got = step(lora, streamed)
    loss0, want = step(lora, frozen)
    assert_grads_match(float(loss), jax.tree.leaves(got), float(loss0), jax.tree.leaves(want))
    # remat offload over the unrolled layers with the explicit transfer (`jaxft.memory.offload`, what `auto` takes
    # there), whose custom VJP hoists the 4-bit layers' code table (a constant of the layer) into arguments:
    # differentiating it closed over raised JAX's "differentiation of a custom_vjp with respect to a closed-over
    # value". The gradients of the scan's; fp32, differently fused loops: 1e-5 of each leaf's largest entry.
    unrolled = ExecutionConfig(attention_implementation="reference", remat="offload", layer_loop="unroll",
                               offload_transfer="explicit")
    loss_u, got_u = jax.jit(lambda lo, fz: loss_and_grad_sums(graphdef, lo, fz, batch, None, unrolled)[:2])(
        lora, unstack_layers(frozen))
    assert_grads_match(float(loss_u), jax.tree.leaves(got_u), float(loss0), jax.tree.leaves(want), scale_tol=1e-5)


def _bnb_rel_error(weight: torch.Tensor) -> float:
    q, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    back = bnb.functional.dequantize_4bit(q, state)
    return float(torch.linalg.norm(back - weight) / torch.linalg.norm(weight))


def test_dynamic_quantiser_decides_per_layer_and_module(base, ids, tmp_path, capsys):
    # Heavy tails in layer 2's v_proj alone: its blocks' absmax grows and the rest lose precision.
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        hf.model.layers[2].self_attn.v_proj.weight[:, ::16] *= 12.0
    path = tmp_path / "tails"
    hf.save_pretrained(path)
    errors = {name: _bnb_rel_error(m.weight.detach()) for name, m in hf.named_modules()
              if isinstance(m, torch.nn.Linear) and "lm_head" not in name}
    bad = "model.layers.2.self_attn.v_proj"
    worst_other = max(e for name, e in errors.items() if name != bad)
    assert errors[bad] > worst_other * 1.2
    cfg = QuantConfig(skip_modules=("lm_head", "model.layers.0.mlp.down_proj"),
                      max_rel_error=(errors[bad] + worst_other) / 2)
    ours = jaxft.from_pretrained(path, dtype="float32", quant_config=cfg)
    printed = capsys.readouterr().out
    assert "model.layers.{i}.self_attn.v_proj in layers [2]: relative error" in printed
    assert "model.layers.{i}.mlp.down_proj in layers [0]: by name (skip_modules)" in printed
    assert "MiB for the layers kept dense over max_rel_error" in printed and "MiB more than in 4 bits" in printed
    assert ours.layers.attn.v_proj.quant_rows == (True, True, False, True)
    assert ours.layers.mlp.down_proj.quant_rows == (False, True, True, True)
    assert ours.layers.attn.q_proj.quant_rows is None and ours.layers.attn.q_proj.kernel is None
    # What the report counts per layer kept dense is what a layer saves in 4 bits.
    q = ours.layers.attn.q_proj.quant
    assert 4 * layer_saving(64, 64, cfg, jnp.float32) == saved_bytes(q, jnp.float32) > 0
    assert sorted(ours.quant_skipped) == ["lm_head", "model.layers.0.mlp.down_proj", bad]
    jaxft.save_pretrained(ours, tmp_path / "q", quantized=True)
    assert _skip_list(tmp_path / "q") == ["lm_head", "model.layers.0.mlp.down_proj", bad]
    loaded = _hf_load(tmp_path / "q")
    assert type(loaded.model.layers[2].self_attn.v_proj) is torch.nn.Linear
    assert isinstance(loaded.model.layers[1].self_attn.v_proj, bnb.nn.Linear4bit)
    assert rel_err(jax_logits(ours, ids), torch_logits(_dequantized(loaded), ids)) < TOL


def test_greedy_generation_matches_the_oracle(model, oracle):
    """The KV-cache forward (`jaxft.generation`) reads each layer's own format too, scanned by runs of one layout."""
    prompts = [list(range(5, 12)), list(range(20, 33))]
    got = generate_ids(model, prompts, max_new_tokens=6, stop_token_ids=[])
    for prompt, row in zip(prompts, got):
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(torch_logits(oracle, [ids])[0, -1].argmax()))
        assert row == ids[len(prompt):]
