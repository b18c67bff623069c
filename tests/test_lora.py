"""jaxft.lora against PEFT (the oracle): targeting, init, logits, adapter round trips, merging, gradients.

Tiny random Llama and Qwen3 models are built from configs here; prompts are 512 tokens so RoPE/attention
errors would show. Everything runs in fp32 on CPU; parity bars are 1e-4 relative (max abs error / max abs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import warnings

import numpy as np
import optax
import peft
import pytest
import torch
import transformers

import jax
import jax.numpy as jnp
from flax import nnx

import jaxft
from jaxft import lora
from jaxft.lora.targets import _modules
from jaxft.config import ConfigError
from jaxft.models import linears
from lora_helpers import perturb_lora_b, rel_err

SEQ = 512
VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
MODEL_TYPES = ("llama", "qwen3")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

VARIANTS = {
    "plain": dict(r=4, alpha=8, target_modules=ALL),
    "rslora": dict(r=4, alpha=16, target_modules="all-linear", use_rslora=True),
    # Layer-specific rank (q_proj layer 1: 2 < r_max 4 -> padding), a rank above r, per-module alphas.
    "patterns": dict(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"),
                     rank_pattern={"model.layers.1.self_attn.q_proj": 2, "up_proj": 6},
                     alpha_pattern={"v_proj": 3, "model.layers.0.mlp.up_proj": 24}),
    # Every linear, with padding and per-module alphas (the gradient test's variant).
    "all_patterns": dict(r=4, alpha=8, target_modules=ALL, rank_pattern={"model.layers.1.self_attn.q_proj": 2,
                                                                         "up_proj": 6, "o_proj": 1},
                         alpha_pattern={"v_proj": 3, "model.layers.0.mlp.down_proj": 24}),
    # Only layer 1 is targeted: layer 0 of each stack has scale 0.
    "regex": dict(r=4, alpha=8, target_modules=r".*\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.down_proj)"),
    "exclude": dict(r=2, alpha=4, target_modules="all-linear", exclude_modules=("model.layers.0.mlp.down_proj",
                                                                                 "o_proj")),
}


# --------------------------------------------------------------------------- helpers


def _hf_model(model_type: str, seed: int = 0):
    config = transformers.AutoConfig.for_model(model_type, **BASE)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # default norms are all ones: randomise so a mis-mapped tensor shows
                p.normal_(1.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for model_type in MODEL_TYPES:
        path = tmp_path_factory.mktemp(f"base_{model_type}")
        _hf_model(model_type).save_pretrained(path, safe_serialization=True)
        out[model_type] = path
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, (1, SEQ)).astype(np.int32)


def _fresh_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _peft_config(fields: dict) -> peft.LoraConfig:
    cfg = lora.LoraConfig(**fields)
    return peft.LoraConfig(**cfg.peft_fields(), task_type="CAUSAL_LM")


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


# One jitted forward for the file: models of one structure (graph and shapes) share its traced program.
_forward = nnx.jit(lambda m, x: m(x))


def _logits(model, ids):
    return np.asarray(_forward(model, jnp.asarray(ids)))




def _perturb_peft(model, seed: int = 1, std: float = 0.1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)


def _peft_modules(peft_model) -> dict[str, tuple[int, float]]:
    """{HF module name: (rank, scale)} of every LoRA layer PEFT created."""
    out = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            out[name] = (module.r["default"], module.scaling["default"])
    return out


def _our_modules(model) -> dict[str, tuple[int, float]]:
    out = {}
    sites = {site.path: site for site in _modules(model).sites}
    for path, lin in linears(model):
        if not lin.has_lora:
            continue
        site = sites[tuple(path.split("."))]
        ranks, scales = np.asarray(lin.lora_rank[...]), np.asarray(lin.lora_scale[...])
        for layer, name in enumerate(site.names()):
            if ranks[layer]:
                out[name] = (int(ranks[layer]), float(scales[layer]))
    return out


@contextlib.contextmanager
def _captured():
    """Collects Python warnings and WARNING+ records of the transformers and peft loggers."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(f"log {record.name}: {record.getMessage()}")

    handler = Collect(level=logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("transformers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        messages.extend(f"{w.category.__name__}: {w.message}" for w in caught)


def _peft_load(base_path, adapter_path, **kw):
    hf = _fresh_hf(base_path)
    with _captured() as messages:
        model = peft.PeftModel.from_pretrained(hf, adapter_path, **kw)
    return model, messages


# --------------------------------------------------------------------------- targeting and init


# Every variant on Llama; Qwen3 (same LoRA code path, different attention block) on the two richest ones.
CASES = [("llama", v) for v in sorted(VARIANTS)] + [("qwen3", "all_patterns"), ("qwen3", "regex")]


@pytest.mark.parametrize("model_type, variant", CASES)
def test_targets_ranks_and_scales_equal_peft(bases, model_type, variant):
    fields = VARIANTS[variant]
    model = lora.apply_lora(jaxft.from_pretrained(bases[model_type], dtype="float32"), lora.LoraConfig(**fields))
    reference = peft.get_peft_model(_fresh_hf(bases[model_type]), _peft_config(fields))
    expected = _peft_modules(reference)
    _assert_same_modules(_our_modules(model), expected)
    assert sorted(lora.target_names(model, lora.LoraConfig(**fields))) == sorted(expected)


def _assert_same_modules(ours, expected):
    assert sorted(ours) == sorted(expected)
    for name, (rank, scale) in expected.items():
        assert ours[name][0] == rank, name
        assert ours[name][1] == pytest.approx(scale, rel=1e-6), name


def test_init_matches_peft_distribution_and_is_fp32(bases):
    model = jaxft.from_pretrained(bases["llama"], dtype="bfloat16")
    cfg = lora.LoraConfig(**VARIANTS["patterns"], dropout=0.1)
    lora.apply_lora(model, cfg, seed=3)
    # PEFT: nn.init.kaiming_uniform_(lora_A.weight [r, in], a=sqrt(5)) -> U(-b, b), b = gain * sqrt(3 / fan_in).
    gain = torch.nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    for path, lin in linears(model):
        if not lin.has_lora:
            continue
        a, b = np.asarray(lin.lora_a[...]), np.asarray(lin.lora_b[...])
        ranks = np.asarray(lin.lora_rank[...])
        assert lin.lora_a.dtype == lin.lora_b.dtype == lin.lora_scale.dtype == jnp.float32, path
        assert lin.kernel.dtype == jnp.bfloat16
        assert lin.lora_dropout == 0.1
        assert not b.any(), "B starts at zero"
        bound = gain * math.sqrt(3.0 / lin.in_features)
        for layer, r in enumerate(ranks):
            live = a[layer, :, :r]
            assert not a[layer, :, r:].any(), f"{path} layer {layer}: padding must be zero"
            if r:
                assert np.abs(live).max() <= bound
                assert np.abs(live).max() > 0.8 * bound
        live = np.concatenate([a[layer, :, :r].ravel() for layer, r in enumerate(ranks)])
        assert np.std(live) == pytest.approx(bound / math.sqrt(3.0), rel=0.15), path
    # Different seeds give different adapters, the same seed the same ones.
    again = lora.apply_lora(jaxft.from_pretrained(bases["llama"], dtype="bfloat16"), cfg, seed=3)
    other = lora.apply_lora(jaxft.from_pretrained(bases["llama"], dtype="bfloat16"), cfg, seed=4)
    a0, a1, a2 = (np.asarray(m.layers.attn.q_proj.lora_a[...]) for m in (model, again, other))
    assert np.array_equal(a0, a1) and not np.array_equal(a0, a2)


def test_dropout_is_read_from_config(bases, ids):
    model = lora.apply_lora(jaxft.from_pretrained(bases["llama"], dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, dropout=0.5, target_modules=["q_proj", "v_proj"]))
    perturb_lora_b(model)
    assert {lin.lora_dropout for _, lin in linears(model) if lin.has_lora} == {0.5}
    x = jnp.asarray(ids[:, :64])
    forward = nnx.jit(lambda m, x, rng: m(x, dropout_rng=rng))
    plain = np.asarray(forward(model, x, None))
    dropped = np.asarray(forward(model, x, jax.random.key(0)))
    assert rel_err(dropped, plain) > 1e-3


# --------------------------------------------------------------------------- logits: export -> PEFT


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_loads_in_peft_without_warnings_and_logits_match(bases, ids, tmp_path, model_type):
    fields = dict(r=4, alpha=8, target_modules="all-linear")
    model = lora.apply_lora(jaxft.from_pretrained(bases[model_type], dtype="float32"), lora.LoraConfig(**fields))
    perturb_lora_b(model)
    ours = _logits(model, ids)
    lora.save_adapter(model, tmp_path / "ours", base_model_name_or_path="tiny/base")

    # What loading an adapter PEFT itself wrote emits in this environment (e.g. deprecation notices that PEFT
    # triggers inside transformers): loading ours must add nothing to it.
    written = peft.get_peft_model(_fresh_hf(bases[model_type]), _peft_config(fields))
    written.save_pretrained(tmp_path / "peft")
    _, baseline = _peft_load(bases[model_type], tmp_path / "peft")
    reference, messages = _peft_load(bases[model_type], tmp_path / "ours")
    assert [m for m in messages if m not in baseline] == []
    assert reference.peft_config["default"].base_model_name_or_path == "tiny/base"

    expected = _torch_logits(reference, ids)
    base_only = _torch_logits(_fresh_hf(bases[model_type]), ids)
    assert rel_err(expected, base_only) > 1e-2, "the perturbed adapter must change the logits"
    assert rel_err(ours, expected) < 1e-4


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("model_type, variant", CASES)
def test_round_trips_with_peft(bases, ids, tmp_path, model_type, variant):
    fields = VARIANTS[variant]
    base = bases[model_type]

    # PEFT-created adapter -> load_adapter -> same logits as PEFT.
    created = peft.get_peft_model(_fresh_hf(base), _peft_config(fields)).eval()
    _perturb_peft(created)
    expected = _torch_logits(created, ids)
    created.save_pretrained(tmp_path / "from_peft")
    loaded = lora.load_adapter(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "from_peft")
    _assert_same_modules(_our_modules(loaded), _peft_modules(created))
    if fields["target_modules"] != "all-linear":  # PEFT stores "all-linear" resolved to names
        assert loaded.lora_config == lora.LoraConfig(**fields)
    assert rel_err(_logits(loaded, ids), expected) < 1e-4

    # Our adapter -> PEFT -> same logits as ours (and PEFT builds the same modules, ranks and scales).
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"), lora.LoraConfig(**fields), seed=5)
    perturb_lora_b(model, seed=6)
    ours = _logits(model, ids)
    lora.save_adapter(model, tmp_path / "from_ours")
    reference, messages = _peft_load(base, tmp_path / "from_ours")
    _, baseline = _peft_load(base, tmp_path / "from_peft")  # what PEFT's own file emits in this environment
    assert [m for m in messages if m not in baseline] == []
    _assert_same_modules(_our_modules(model), _peft_modules(reference))
    assert rel_err(ours, _torch_logits(reference, ids)) < 1e-4

    # ... and back: our file read by us gives bit-identical adapters.
    back = lora.load_adapter(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "from_ours")
    for (path, lin), (_, lin_back) in zip(linears(model), linears(back)):
        assert lin.has_lora == lin_back.has_lora, path
        if lin.has_lora:
            for attr in ("lora_a", "lora_b", "lora_scale", "lora_rank"):
                assert np.array_equal(np.asarray(getattr(lin, attr)[...]), np.asarray(getattr(lin_back, attr)[...]))


# --------------------------------------------------------------------------- merging


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_merge_matches_peft_merged(bases, ids, tmp_path, model_type):
    fields = VARIANTS["patterns"]
    model = lora.apply_lora(jaxft.from_pretrained(bases[model_type], dtype="float32"), lora.LoraConfig(**fields))
    perturb_lora_b(model)
    ours = _logits(model, ids)
    lora.save_adapter(model, tmp_path / "adapter")
    merged_ref = _torch_logits(_peft_load(bases[model_type], tmp_path / "adapter")[0].merge_and_unload(), ids)

    # Export merges without touching the model.
    jaxft.save_pretrained(model, tmp_path / "merged")
    assert model.layers.attn.q_proj.has_lora
    exported = _torch_logits(_fresh_hf(tmp_path / "merged"), ids)
    assert rel_err(exported, merged_ref) < 1e-4

    kernels = lora.merged_kernels(model)
    assert set(kernels) == {("layers", "attn", "q_proj", "kernel"), ("layers", "attn", "v_proj", "kernel"),
                            ("layers", "mlp", "up_proj", "kernel")}
    # In-place merge: same function, adapters gone.
    lora.merge_lora(model)
    assert not lora_state_leaves(model)
    assert model.lora_config is None
    assert rel_err(_logits(model, ids), ours) < 1e-5
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.save_adapter(model, tmp_path / "nothing")


def lora_state_leaves(model):
    return jax.tree.leaves(lora.lora_state(model))


# --------------------------------------------------------------------------- gradients


def _our_grads(model, ids):
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)
    tokens = jnp.asarray(ids)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params, rest)(tokens)[:, :-1].astype(jnp.float32)
        targets = tokens[:, 1:]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return nll.sum() / targets.size  # sum of token CE / number of target tokens

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    return float(loss), grads, params


@pytest.mark.parametrize("model_type,variant", [("llama", "all_patterns"), ("qwen3", "plain")])
def test_lora_gradients_equal_peft(bases, ids, tmp_path, model_type, variant):
    base = bases[model_type]
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"), lora.LoraConfig(**VARIANTS[variant]))
    perturb_lora_b(model)
    loss, grads, params = _our_grads(model, ids)

    lora.save_adapter(model, tmp_path / "adapter")
    reference, _ = _peft_load(base, tmp_path / "adapter", is_trainable=True)
    tokens = torch.tensor(ids, dtype=torch.long)
    logits = reference(tokens).logits[:, :-1].float()
    targets = tokens[:, 1:]
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                                 reduction="sum") / targets.numel()
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)

    sites = {site.path: site for site in _modules(model).sites}
    flat = {tuple(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    torch_modules = dict(reference.base_model.model.named_modules())
    compared = 0
    for path, lin in linears(model):
        if not lin.has_lora:
            continue
        key = tuple(path.split("."))
        ga, gb = flat[(*key, "lora_a")], flat[(*key, "lora_b")]
        ranks = np.asarray(lin.lora_rank[...])
        for layer, name in enumerate(sites[key].names()):
            r = int(ranks[layer])
            # Padding (and untargeted layers) gets exactly zero gradient: it stays zero in training.
            assert not ga[layer, :, r:].any() and not gb[layer, r:, :].any(), name
            if not r:
                continue
            module = torch_modules[name]
            ref_a = module.lora_A["default"].weight.grad.numpy()  # [r, in] = our A^T
            ref_b = module.lora_B["default"].weight.grad.numpy()  # [out, r] = our B^T
            assert rel_err(ga[layer, :, :r].T, ref_a) < 1e-4, f"{name}.lora_A"
            assert rel_err(gb[layer, :r, :].T, ref_b) < 1e-4, f"{name}.lora_B"
            compared += 1
    assert compared == len(_peft_modules(reference))

    # One AdamW step with weight decay leaves the padding exactly zero.
    opt = optax.adamw(1e-2, weight_decay=0.1)
    # jitted: one program (op by op, every leaf shape's eager ops compile on their own)
    stepped = jax.jit(lambda g, p: optax.apply_updates(p, opt.update(g, opt.init(p), p)[0]))(grads, params)
    for path, var in nnx.to_flat_state(stepped):
        key = tuple(str(p) for p in path)
        lin = model
        for part in key[:-1]:
            lin = getattr(lin, part)
        ranks = np.asarray(lin.lora_rank[...])
        value = np.asarray(var[...])
        for layer, r in enumerate(ranks):
            pad = value[layer, :, r:] if key[-1] == "lora_a" else value[layer, r:, :]
            assert not pad.any(), (key, layer)


# --------------------------------------------------------------------------- errors


def test_unmatched_target_lists_available_modules(bases):
    model = jaxft.from_pretrained(bases["llama"], dtype="float32")
    with pytest.raises(ConfigError) as err:
        lora.apply_lora(model, lora.LoraConfig(target_modules=["q_proj", "query_key_value"]))
    msg = str(err.value)
    assert "'query_key_value'" in msg
    for name in ALL:
        assert name in msg
    assert "model.layers.0.self_attn.q_proj" in msg
    assert not any(lin.has_lora for _, lin in linears(model)), "a failed apply_lora leaves the model untouched"

    # A plain string is a regex on the full name (PEFT semantics): say so.
    with pytest.raises(ConfigError, match="fullmatch"):
        lora.apply_lora(model, lora.LoraConfig(target_modules="q_proj"))


@pytest.mark.parametrize("fields, match", [
    (dict(target_modules=["lm_head"]), "output head"),
    (dict(target_modules=["embed_tokens"]), "not a linear layer"),
    (dict(target_modules=r".*norm"), "not a linear layer"),
    (dict(target_modules=["q_proj"], rank_pattern={"v_proj": 2}), "rank_pattern key 'v_proj' matches none"),
    (dict(target_modules=["q_proj"], alpha_pattern={"layers.7.self_attn.q_proj": 2}), "alpha_pattern key"),
    (dict(target_modules=["q_proj"], exclude_modules=["k_proj"]), "excludes none"),
    (dict(target_modules=["q_proj"], exclude_modules=r".*q_proj"), "removes every module"),
])
def test_targeting_errors(bases, fields, match):
    model = jaxft.from_pretrained(bases["llama"], dtype="float32")
    with pytest.raises(ConfigError, match=match):
        lora.apply_lora(model, lora.LoraConfig(**fields))


@pytest.mark.parametrize("fields, match", [
    (dict(r=0), "LoraConfig.r: value 0 must be a positive integer"),
    (dict(alpha=-1), "LoraConfig.alpha"),
    (dict(dropout=1.0), "LoraConfig.dropout"),
    (dict(target_modules=[]), "target_modules"),
    (dict(target_modules="(q_proj"), "not a valid regular expression"),
    (dict(rank_pattern={"q_proj": 0}), r"LoraConfig.rank_pattern: value 0 of 'q_proj' must be"),
    (dict(use_rslora="yes"), "use_rslora"),
])
def test_config_validation(fields, match):
    with pytest.raises(ConfigError, match=match):
        lora.LoraConfig(**fields)


def test_config_normalises_and_converts():
    cfg = lora.LoraConfig(target_modules=["v_proj", "q_proj"], rank_pattern={"q_proj": 2})
    assert cfg.target_modules == ("q_proj", "v_proj")
    assert lora.LoraConfig(target_modules="ALL-LINEAR").target_modules == "all-linear"
    assert hash(cfg) == hash(lora.LoraConfig(target_modules=("v_proj", "q_proj"), rank_pattern={"q_proj": 2}))
    assert lora.LoraConfig.from_peft(_peft_config(VARIANTS["patterns"]).to_dict()) == lora.LoraConfig(
        **VARIANTS["patterns"])


def test_apply_twice_is_refused(bases):
    model = lora.apply_lora(jaxft.from_pretrained(bases["llama"], dtype="float32"), lora.LoraConfig())
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.apply_lora(model, lora.LoraConfig())


def test_load_adapter_errors(bases, tmp_path):
    # An adapter for another architecture size: shapes do not fit, named with the file.
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **{**BASE, "intermediate_size": 128}), dtype=torch.float32)
    peft.get_peft_model(other, _peft_config(dict(r=4, alpha=8, target_modules=["down_proj"]))).save_pretrained(
        tmp_path / "wrong")
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: model\.layers\.0\.mlp\.down_proj"):
        lora.load_adapter(jaxft.from_pretrained(bases["llama"], dtype="float32"), tmp_path / "wrong")
    # Unsupported PEFT features are refused by name.
    peft.get_peft_model(_fresh_hf(bases["llama"]), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True,
                                                                   task_type="CAUSAL_LM")).save_pretrained(
        tmp_path / "dora")
    with pytest.raises(ValueError, match="DoRA"):
        lora.load_adapter(jaxft.from_pretrained(bases["llama"], dtype="float32"), tmp_path / "dora")


def test_load_adapter_checks_config_against_weights(bases, tmp_path):
    fresh = lambda: jaxft.from_pretrained(bases["llama"], dtype="float32")  # noqa: E731
    peft.get_peft_model(_fresh_hf(bases["llama"]), _peft_config(dict(r=2, alpha=4, target_modules=["q_proj"]))
                        ).save_pretrained(tmp_path / "a")
    cfg_file = tmp_path / "a" / "adapter_config.json"
    original = json.loads(cfg_file.read_text())
    for targets, match in ((["q_proj", "k_proj"], "no LoRA weights for 2 module"),
                           (r".*\.1\.self_attn\.q_proj", "does not target")):
        cfg_file.write_text(json.dumps({**original, "target_modules": targets}))
        with pytest.raises(ValueError, match=match):
            lora.load_adapter(fresh(), tmp_path / "a")

    # An adapter on the output head (PEFT allows it) cannot be represented: refused, naming the file.
    peft.get_peft_model(_fresh_hf(bases["llama"]), _peft_config(dict(r=2, alpha=4, target_modules=["lm_head"]))
                        ).save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match=r"(?s)head/adapter_model\.safetensors: .*lm_head.*output head"):
        lora.load_adapter(fresh(), tmp_path / "head")
