"""modules_to_save and trainable tokens against transformers + PEFT (the oracle): gradients of the trained
embeddings / head / rows, and adapters moving both ways (PEFT-saved into jaxft, jaxft-saved into PEFT) with equal
logits. A tiny Llama, untied and tied, on 512-token inputs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml
from safetensors import safe_open

import jax
import jax.numpy as jnp
from flax import nnx

import jaxft
from jaxft import lora
from jaxft.config import ConfigError
from jaxft.models.layers import SavedParam, TokenRows
from jaxft.train import TrainConfig, train
from jaxft.train.step import split_model, token_loss_sum
from lora_helpers import rel_err

VOCAB, SEQ = 96, 512
TOKENS = [3, 17, 40, 95]
CASES = {
    "untied_saved": (False, dict(modules_to_save=["embed_tokens", "lm_head"])),
    "tied_saved": (True, dict(modules_to_save=["embed_tokens", "lm_head"])),
    "tied_embed_only": (True, dict(modules_to_save=["embed_tokens"])),
    "tied_ensure": (True, dict(modules_to_save=["embed_tokens"], ensure_weight_tying=True)),
    "untied_tokens": (False, dict(trainable_token_indices={"embed_tokens": TOKENS, "lm_head": TOKENS[:2]})),
    "tied_tokens": (True, dict(trainable_token_indices=TOKENS)),
}


def _hf(tied: bool, seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for tied in (False, True):
        path = tmp_path_factory.mktemp(f"base_tied{tied}")
        _hf(tied).save_pretrained(path)
        out[tied] = path
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, (1, SEQ)).astype(np.int32)


def _fresh(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _peft_model(path, extra: dict):
    """A PEFT model on q/v with every trained tensor moved off its init (B off zero, tables and rows perturbed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_fresh(path), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                                                  "v_proj"], **extra))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _torch_loss_grads(model, ids):
    model.zero_grad()
    x = torch.tensor(ids, dtype=torch.long)
    logits = model(x).logits
    loss = F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
    loss.backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.requires_grad and "lora" not in n}


def _batch(ids):
    t = ids.shape[1]
    targets = np.concatenate([ids[:, 1:], np.zeros((1, 1), np.int32)], 1)
    mask = (np.arange(t) < t - 1).astype(np.float32)[None]
    return dict(input_ids=jnp.asarray(ids), targets=jnp.asarray(targets), loss_mask=jnp.asarray(mask),
                segment_ids=jnp.ones((1, t), jnp.int32), positions=jnp.arange(t, dtype=jnp.int32)[None])


def _logits_and_grads(models: dict, ids) -> dict:
    """{name: (logits, gradients of the trained tensors through the training loss, `token_loss_sum`)} of every
    model in `models`: one program for them all, the weights its arguments."""
    batch = _batch(ids)
    splits = {name: split_model(model) for name, model in models.items()}

    def one(graphdef, tr, fz):
        grad = jax.grad(lambda tr: token_loss_sum(nnx.merge(graphdef, tr, fz), batch))(tr)
        return nnx.merge(graphdef, tr, fz)(batch["input_ids"]), grad

    run = jax.jit(lambda parts: {name: one(splits[name][0], *parts[name]) for name in parts})
    out = run({name: (trainable, frozen) for name, (_, trainable, frozen) in splits.items()})
    return {name: (np.asarray(logits), {".".join(map(str, p)): np.asarray(v.get_value())
                                        for p, v in nnx.to_flat_state(grad)})
            for name, (logits, grad) in out.items()}


def _logits(model, ids):
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def peft_saved(bases, tmp_path_factory, ids):
    """{case: (PEFT adapter dir, PEFT logits, PEFT grads of the trained tables/rows)}."""
    out = {}
    for case, (tied, extra) in CASES.items():
        model = _peft_model(bases[tied], extra)
        path = tmp_path_factory.mktemp(f"peft_{case}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(path)
        out[case] = (path, _torch_logits(model, ids), _torch_loss_grads(model, ids))
    return out


# PEFT parameter name -> jaxft trainable path (torch layout: lm_head's kernel is the transpose).
_PATHS = {
    "model.embed_tokens.modules_to_save.default.weight": ("embed.embedding", False),
    "lm_head.modules_to_save.default.weight": ("lm_head.kernel", True),
    "model.embed_tokens.token_adapter.trainable_tokens_delta.default": ("embed.token_rows", False),
    "lm_head.token_adapter.trainable_tokens_delta.default": ("lm_head.token_rows", False),
}


@pytest.fixture(scope="module")
def loaded(bases, peft_saved, ids):
    """{case: (jaxft's model with the case's PEFT adapter loaded, its logits, its gradients)}, the logits and
    gradients of the six from one program."""
    models = {case: lora.load_adapter(jaxft.from_pretrained(bases[tied], dtype="float32", verbose=False),
                                      peft_saved[case][0]) for case, (tied, _) in CASES.items()}
    return {case: (models[case], *out) for case, out in _logits_and_grads(models, ids).items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_ways_with_peft_equal_logits_and_grads(bases, peft_saved, loaded, ids, tmp_path, case):
    """A PEFT adapter loads in jaxft: equal logits, and equal gradients of the trained tables / rows (every
    trained tensor off its init, LoRA B included). Saved again by jaxft, PEFT loads it: equal logits, the same
    tensor keys and config fields."""
    tied, extra = CASES[case]
    path, want_logits, want_grads = peft_saved[case]
    model, logits, grads = loaded[case]
    assert rel_err(logits, want_logits) < 2e-5
    assert want_grads
    for name, want in want_grads.items():
        ours, transposed = _PATHS[name.removeprefix("base_model.model.")]
        got = grads[ours].T if transposed else grads[ours]
        assert rel_err(got, want) < 2e-4, name

    out = lora.save_adapter(model, tmp_path / "ours")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(_fresh(bases[tied]), out)
    assert rel_err(_torch_logits(peft_model, ids), logits) < 2e-5
    with safe_open(path / "adapter_model.safetensors", "np") as a, safe_open(out / "adapter_model.safetensors",
                                                                             "np") as b:
        assert set(a.keys()) == set(b.keys())
    config = json.loads((out / "adapter_config.json").read_text())
    for key, value in extra.items():
        assert config[key] == value


def test_fresh_apply_matches_peft_init_and_types(bases, ids, tmp_path):
    """apply_lora: the tables start as the base's (B = 0: base logits), typed as trainable, in the split's
    trainable half; a merged export (transformers loads it) and merge_lora fold them in."""
    model = jaxft.from_pretrained(bases[True], dtype="float32", verbose=False)
    base = _logits(model, ids)
    lora.apply_lora(model, lora.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                           trainable_token_indices=TOKENS))
    assert isinstance(model.lm_head.kernel, SavedParam) and isinstance(model.embed.token_rows, TokenRows)
    assert rel_err(_logits(model, ids), base) < 1e-6
    _, trainable, _ = split_model(model)
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    assert {"lm_head.kernel", "embed.token_rows"} <= paths
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 1.5
    model.embed.token_rows[...] = model.embed.token_rows[...] + 0.3
    before = _logits(model, ids)
    merged = jaxft.save_pretrained(model, tmp_path / "merged")  # the head untied from the table: both written
    assert rel_err(_torch_logits(_fresh(merged), ids), before) < 1e-5
    lora.merge_lora(model)
    assert not isinstance(model.lm_head.kernel, SavedParam) and model.embed.token_rows is None
    assert rel_err(_logits(model, ids), before) < 1e-6


@pytest.mark.parametrize("extra, match", [
    (dict(modules_to_save=["norm"]), "modules_to_save"),
    (dict(trainable_token_indices=[VOCAB]), "outside the vocabulary"),
    (dict(modules_to_save=["embed_tokens"], trainable_token_indices=[1]), "trained in full already"),
    (dict(trainable_token_indices=[1, 1]), "twice"),
])
def test_bad_configs_name_the_field(bases, extra, match):
    model = jaxft.from_pretrained(bases[False], dtype="float32", verbose=False)
    with pytest.raises(ConfigError, match=match):
        lora.apply_lora(model, lora.LoraConfig(r=4, target_modules=["q_proj"], **extra))


def test_tied_head_rows_apart_from_the_embedding_are_refused(bases):
    model = jaxft.from_pretrained(bases[True], dtype="float32", verbose=False)
    with pytest.raises(ConfigError, match="share one table"):
        lora.apply_lora(model, lora.LoraConfig(r=4, target_modules=["q_proj"],
                                               trainable_token_indices={"lm_head": [1, 2]}))


def test_peft_adapter_saving_a_module_jaxft_cannot_train_is_refused(bases, tmp_path):
    model = _peft_model(bases[False], dict(modules_to_save=["norm"]))
    model.save_pretrained(tmp_path / "norm")
    with pytest.raises(ConfigError, match=r"adapter_config.json: LoraConfig.modules_to_save: 'norm' names no module"):
        lora.load_adapter(jaxft.from_pretrained(bases[False], dtype="float32", verbose=False), tmp_path / "norm")


# --------------------------------------------------------------------------- new tokens


def test_resize_embeddings_matches_transformers_mean_resizing(bases):
    """Old rows kept; new rows of the embeddings and the untied head are the old rows' mean plus noise of 1e-9
    times their covariance, as transformers draws them: both draws lie within a few of that noise's sigmas of
    each other (statistical: the draws are not the same random numbers), and ours is not the bare mean."""
    hf = _fresh(bases[False])
    hf.resize_token_embeddings(VOCAB + 8, mean_resizing=True)
    model = jaxft.from_pretrained(bases[False], dtype="float32", verbose=False)
    lora.resize_embeddings(model, VOCAB + 8)
    assert model.config.vocab_size == VOCAB + 8
    old = _fresh(bases[False])
    for ours, theirs, before in ((model.embed.embedding[...], hf.model.embed_tokens.weight,
                                  old.model.embed_tokens.weight),
                                 (model.lm_head.kernel[...].T, hf.lm_head.weight, old.lm_head.weight)):
        ours, theirs, before = np.asarray(ours), theirs.detach().numpy(), before.detach().numpy()
        np.testing.assert_array_equal(ours[:VOCAB], before)
        sigma = np.sqrt(1e-9 * before.var(axis=0))
        mean = before.mean(axis=0)
        assert np.abs(ours[VOCAB:] - theirs[VOCAB:]).max(axis=0).max() < 6 * np.sqrt(2) * sigma.max()
        z = (ours[VOCAB:] - mean) / sigma
        assert 0.3 < z.std() < 3


def test_new_tokens_both_ways_with_peft(bases, tmp_path, ids):
    """New tokens trained as token rows: a PEFT adapter (base resized by transformers) loads in jaxft (base
    resized by jaxft) with equal logits, and the adapter jaxft saves loads in PEFT: the trained rows replace the
    new rows, so the two resizes' different draws do not matter."""
    new = [VOCAB, VOCAB + 1, VOCAB + 2]
    text = ids.copy()
    text[0, ::5] = VOCAB + 1
    for tied in (False, True):
        hf = _fresh(bases[tied])
        hf.resize_token_embeddings(VOCAB + 3)
        cfg = lora.new_token_config(lora.LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), new, tied)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = peft.get_peft_model(hf, peft.LoraConfig(**cfg.peft_fields()))
        torch.manual_seed(1)
        with torch.no_grad():
            for _, p in theirs.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
        theirs.save_pretrained(tmp_path / f"peft{tied}")
        model = jaxft.from_pretrained(bases[tied], dtype="float32", verbose=False)
        lora.resize_embeddings(model, VOCAB + 3, seed=5)
        lora.load_adapter(model, tmp_path / f"peft{tied}")
        assert rel_err(_logits(model, text), _torch_logits(theirs, text)) < 2e-5
        # PEFT stored its resized base tables too: a base jaxft did not resize takes them (and their size).
        grown = lora.load_adapter(jaxft.from_pretrained(bases[tied], dtype="float32", verbose=False),
                                  tmp_path / f"peft{tied}")
        assert rel_err(_logits(grown, text), _torch_logits(theirs, text)) < 2e-5
        out = lora.save_adapter(model, tmp_path / f"ours{tied}")
        back = _fresh(bases[tied])
        back.resize_token_embeddings(VOCAB + 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = peft.PeftModel.from_pretrained(back, out)
        assert rel_err(_torch_logits(back, text), _logits(model, text)) < 2e-5


# --------------------------------------------------------------------------- jaxft-train


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-llama"


def test_train_run_trains_saves_and_resumes_modules_to_save(tmp_path):
    """`modules_to_save` in a training run: the tables move, the checkpoint holds them (and their optimizer
    state), a resume continues from them, and the exported adapter loads in PEFT with equal logits."""
    values = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    data = tmp_path / "train.jsonl"  # the quickstart's first chats: 3 steps of 2 packed rows need far fewer than 3000
    data.write_text("".join((ROOT / values["dataset"]).read_text().splitlines(keepends=True)[:96]), encoding="utf-8")
    # a constant rate: the resumed run (3 steps) compiles the same step as the first (2 steps), a cache hit
    values.update(model_name_or_path=str(TINY), dataset=str(data), eval_dataset=None, lr_scheduler_type="constant",
                  output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, logging_steps=1, max_seq_length=256,
                  per_device_train_batch_size=2, warmup_steps=0, remat="none", layer_loop="scan",
                  lora_target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"])
    values["add_special_tokens"] = ["<|tool|>"]  # a new token: the tables grow to 1025 rows
    train(TrainConfig(**values))
    run = Path(values["output_dir"])
    ckpt = run / "checkpoints" / "2"
    for part in ("lora", "opt_state"):  # the tables and their Adam moments, by tree path
        names = (ckpt / part / "_METADATA").read_text()
        assert "embedding" in names and "kernel" in names and "lora_a" in names
    train(TrainConfig(**{**values, "max_steps": 3, "resume_from_checkpoint": True}))
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 3
    adapter = run / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter)  # saved with the adapter, new token included
    new_id = tokenizer.convert_tokens_to_ids("<|tool|>")
    assert len(tokenizer) == 1025 and new_id == 1024
    base = jaxft.from_pretrained(TINY, "float32", verbose=False)
    with pytest.raises(ValueError, match="resize_embeddings"):  # as in PEFT: the base is resized first
        lora.load_adapter(jaxft.from_pretrained(TINY, "float32", verbose=False), adapter)
    lora.resize_embeddings(base, len(tokenizer))
    ours = lora.load_adapter(base, adapter)
    base = jaxft.from_pretrained(TINY, "float32", verbose=False)
    assert ours.embed.embedding.shape[0] == 1025
    assert np.abs(np.asarray(ours.embed.embedding[:1024]) - np.asarray(base.embed.embedding[...])).max() > 1e-4
    ids = np.random.default_rng(2).integers(0, 256, (1, 64)).astype(np.int32)
    ids[0, ::7] = new_id
    hf = _fresh(TINY)
    hf.resize_token_embeddings(len(tokenizer))  # what a PEFT user does before loading an adapter with new tokens
    hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    assert rel_err(_logits(ours, ids), _torch_logits(hf, ids)) < 1e-5
