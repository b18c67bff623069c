"""AdamW with 8-bit moments (`optim: adamw_8bit`, jaxft/train/adam8bit.py) against bitsandbytes' AdamW8bit and
torch's fp32 AdamW on CPU. (Through `jaxft-train`, a full fine-tune under FSDP that stores them and resumes exactly:
test_sharding.)"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxft.train import TrainConfig, TrainConfigError
from jaxft.train.adam8bit import SIGNED, UNSIGNED, dequantize, eligible, quantize
from jaxft.train.optim import make_optimizer

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_bitsandbytes_and_rounding_is_to_the_nearest_code(signed):
    ours = SIGNED if signed else UNSIGNED
    theirs = F.create_dynamic_map(signed).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-7)  # float32 linspace roundings differ by an ulp
    x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
    x = x if signed else x**2 * 1e-3  # second moments: small, never negative
    codes, absmax = quantize(jnp.asarray(x), ours)
    q, st = F.quantize_blockwise(torch.from_numpy(x), code=torch.from_numpy(theirs), blocksize=256)
    np.testing.assert_allclose(np.asarray(absmax).reshape(-1), st.absmax.numpy(), rtol=1e-7)
    ours_err = np.abs(np.asarray(dequantize(codes, absmax, ours)) - x)
    theirs_err = np.abs(F.dequantize_blockwise(q, st).numpy() - x)
    assert (ours_err <= theirs_err + 1e-7 * np.abs(x).max()).all()  # the nearest code: never worse than theirs
    assert (np.asarray(codes) == q.numpy()).mean() > 0.95
    assert np.asarray(codes).dtype == np.uint8 and codes.shape == x.shape and absmax.shape == (4, 4)


def test_steps_track_bitsandbytes_adamw8bit_and_torch_adamw():
    """bitsandbytes keeps tensors under 4,096 values in fp32 (`min_8bit_size`), as jaxft does; the 8-bit weight's
    first step equals theirs (moments fresh from zero), later steps stay as close to fp32 AdamW as theirs do."""
    rng = np.random.default_rng(1)
    shapes = {"w": (8, 512), "small": (16, 16), "ragged": (64, 100)}
    assert [eligible(s) for s in shapes.values()] == [True, False, False]
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: 0.1 * rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(6)]
    hyper = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)

    def torch_run(make):
        ps = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in init.items()}
        opt, out = make(list(ps.values())), []
        for g in grads:
            for k, p in ps.items():
                p.grad = torch.from_numpy(g[k].copy())
            opt.step()
            out.append({k: p.detach().numpy().copy() for k, p in ps.items()})
        return out

    theirs = torch_run(lambda ps: bnb.optim.AdamW8bit(ps, **hyper))
    fp32 = torch_run(lambda ps: torch.optim.AdamW(ps, **hyper))
    tx = make_optimizer(hyper["lr"], b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, eight_bit=True)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    state, step, ours = tx.init(params), jax.jit(tx.update), []
    for g in grads:
        updates, state = step({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        params = optax.apply_updates(params, updates)
        ours.append({k: np.asarray(v) for k, v in params.items()})
    adam = state[0]
    assert adam.mu["w"].dtype == adam.nu["w"].dtype == np.uint8 and adam.mu["small"].dtype == np.float32
    np.testing.assert_allclose(ours[0]["w"], theirs[0]["w"], rtol=0, atol=1e-6)
    for k in ("small", "ragged"):
        np.testing.assert_allclose(ours[-1][k], fp32[-1][k], rtol=0, atol=2e-6)
    moved = np.abs(fp32[-1]["w"] - init["w"]).mean()
    ours_off, theirs_off = (np.abs(run[-1]["w"] - fp32[-1]["w"]).mean() for run in (ours, theirs))
    assert ours_off < 0.02 * moved and ours_off < 1.1 * theirs_off, (ours_off, theirs_off, moved)
    # Two moments: 1 byte a value plus a 4-byte scale per 256 for w, 4 bytes a value for the others; the step count.
    fp32_values = 16 * 16 + 64 * 100
    assert sum(x.nbytes for x in jax.tree.leaves(adam)) == 2 * (8 * 512 * (1 + 4 / 256)) + 2 * 4 * fp32_values + 4


def test_optim_key_reads_transformers_names_and_refuses_others(tmp_path):
    base = dict(model_name_or_path=str(REPO / "examples/tiny-llama"), dataset=str(REPO / "examples/data/train.jsonl"),
                output_dir=str(tmp_path))
    assert TrainConfig.from_dict({**base, "optim": "paged_adamw_8bit"}).optim_config.eight_bit
    assert not TrainConfig.from_dict({**base, "optim": "adamw_torch_fused"}).optim_config.eight_bit
    assert not TrainConfig.from_dict(base).optim_config.eight_bit
    with pytest.raises(TrainConfigError, match="optim.*adamw_8bit"):
        TrainConfig.from_dict({**base, "optim": "sgd"})
