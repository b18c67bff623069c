"""Adapters installed on a model (`apply_lora`), merged into its kernels (`merge_lora`, `merged_kernels`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.lora import trained
from jaxft.lora.config import LoraConfig
from jaxft.lora.targets import _modules, _plan, _Site
from jaxft.models.layers import (ExpertParam, Linear, LoraParam, LoraRank, LoraScale, QuantFp8, TrainableParam, linears,
                                 logical)
from jaxft.models.moe import ExpertLora, expert_adapters
from jaxft.models.quant_experts import QuantizedExperts, expert_weight


def _linear(model, path: tuple[str, ...]) -> Linear:
    node = model
    for part in path:
        node = getattr(node, part)
    return node


def _like_kernel(x: jax.Array, kernel: jax.Array, axes: tuple[int | None, ...]) -> jax.Array:
    """Place `x` sharded like `kernel` along the mapped axes (`axes[d]` = kernel axis of x's dim d, or None)."""
    sharding = getattr(kernel, "sharding", None)  # None for a 4-bit linear (no kernel): placed as is
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    new = jax.sharding.PartitionSpec(*(None if a is None else spec[a] for a in axes))
    return jax.device_put(x, jax.sharding.NamedSharding(sharding.mesh, new))


def _random_fill(seed: int):
    """PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.

    Columns j >= r_l of A_l and rows j >= r_l of B_l (padding up to r_max, and everything in layers whose module
    is not targeted) start at exactly zero and get exactly zero gradients, so they stay zero under any optimiser
    whose update of a zero parameter with a zero gradient is zero (SGD, Adam/AdamW incl. decoupled weight decay):
    with g = dL/dy (times s_l), dL/dA_l[:, j] = x^T g B_l[j, :]^T = 0 because row j of B_l is 0, and
    dL/dB_l[j, :] = (x A_l[:, j])^T g = 0 because column j of A_l is 0. (For untargeted layers s_l = 0 as well.)
    """
    def fill(index: int, site: _Site, shape: tuple[int, ...], ranks: np.ndarray):
        # shape: the per-layer weight, [in, out] or [E, in, out] (experts: PEFT's lora_A is one nn.Linear(in,
        # r*E), so its bound is 1/sqrt(in) as well). Drawn on the host (numpy) and moved with device_put: no XLA
        # program to compile per adapter shape (jnp.asarray / jnp.zeros compile one), and A is small.
        *lead, n_in, n_out = shape
        r_max = int(ranks.max())
        bound = 1.0 / math.sqrt(n_in)
        rng = np.random.default_rng([seed, index])
        a = rng.uniform(-bound, bound, (len(ranks), *lead, n_in, r_max)).astype(np.float32)
        a *= (np.arange(r_max) < ranks.reshape(-1, *[1] * (len(lead) + 2)))
        return jax.device_put(a), jax.device_put(np.zeros((len(ranks), *lead, r_max, n_out), np.float32))
    return fill


def _ranks_scales(per_layer) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([p[0] if p else 0 for p in per_layer], np.int32),
            np.array([p[1] if p else 0.0 for p in per_layer], np.float32))


def _expert_shape(holder, slot: str) -> tuple[int, int, int]:
    """(E, in, out) of the expert weight an adapter slot of a MoE MLP adapts."""
    return tuple(getattr(holder, holder.LORA_KERNELS[slot]).shape[-3:])


def _install(model, cfg: LoraConfig, plan, fill) -> None:
    if any(lin.has_lora for _, lin in linears(model)) or expert_adapters(model):
        raise ValueError("the model already has LoRA adapters; merge_lora(model) first to stack a new adapter on "
                         "the merged weights, or start from a freshly loaded base model")
    mods = _modules(model)
    for index, site in enumerate(mods.params, start=len(mods.sites)):
        if site not in plan:
            continue
        holder, slot = _linear(model, site.path[:-1]), site.path[-1]
        ranks, scales = _ranks_scales(plan[site])
        a, b = fill(index, site, _expert_shape(holder, slot), ranks)
        kernel = getattr(holder, holder.LORA_KERNELS[slot])
        kernel = kernel[...] if isinstance(kernel, ExpertParam) else None  # 4-bit experts: placed as is
        adapter = ExpertLora(_like_kernel(a, kernel, (0, 1, 2, None)), _like_kernel(b, kernel, (0, 1, None, None)),
                             _like_kernel(jax.device_put(scales), kernel, (0,)),
                             _like_kernel(jax.device_put(ranks), kernel, (0,)))
        setattr(holder, slot, nnx.data(adapter))
    for index, site in enumerate(mods.sites):
        per_layer = plan.get(site)
        if per_layer is None:
            continue
        lin = _linear(model, site.path)
        ranks, scales = _ranks_scales(per_layer)
        a, b = fill(index, site, (lin.in_features, lin.out_features), ranks)
        kernel = lin.kernel[...] if lin.quant is None else None
        ranks, scales = jax.device_put(ranks), jax.device_put(scales)
        # `nnx.data`: these attributes were None (static) on the fresh Linear and now hold state.
        # Logical axes as the kernel's: A [layers, in, rank], B [layers, rank, out] (jaxft.sharding's rules);
        # a linear outside any stack (the vision merger) has A [in, rank], B [rank, out] and scalar scale/rank.
        lin_in, lin_out = lin.axes
        if not site.stacked:
            a, b, ranks, scales = a[0], b[0], ranks[0], scales[0]
            lin.lora_a = nnx.data(LoraParam(_like_kernel(a, kernel, (0, None)), **logical(lin_in, "lora_rank")))
            lin.lora_b = nnx.data(LoraParam(_like_kernel(b, kernel, (None, 1)), **logical("lora_rank", lin_out)))
            lin.lora_scale, lin.lora_rank = nnx.data(LoraScale(scales)), nnx.data(LoraRank(ranks))
        else:
            lin.lora_a = nnx.data(LoraParam(_like_kernel(a, kernel, (0, 1, None)),
                                            **logical("layers", lin_in, "lora_rank")))
            lin.lora_b = nnx.data(LoraParam(_like_kernel(b, kernel, (0, None, 2)),
                                            **logical("layers", "lora_rank", lin_out)))
            lin.lora_scale = nnx.data(LoraScale(_like_kernel(scales, kernel, (0,)), **logical("layers")))
            lin.lora_rank = nnx.data(LoraRank(_like_kernel(ranks, kernel, (0,)), **logical("layers")))
        lin.lora_dropout = float(cfg.dropout)
    # Static metadata (hashable), kept through nnx.split/merge; save_adapter writes it back as adapter_config.
    model.lora_config = cfg


def apply_lora(model, cfg: LoraConfig, *, seed: int = 0):
    """Adds LoRA adapters to `model` in place (and returns it): A ~ U(+-1/sqrt(in)), B = 0, fp32; and makes the
    modules / token rows of `modules_to_save` / `trainable_token_indices` trainable (`jaxft.lora.trained`).

    Raises ConfigError if a target_modules entry, an exclude_modules value or a rank/alpha pattern key selects
    nothing, or selects a module LoRA cannot adapt (output head, embeddings, norms).
    """
    if not isinstance(cfg, LoraConfig):
        raise TypeError(f"apply_lora needs a jaxft.lora.LoraConfig, got {type(cfg).__name__}; for a PEFT config "
                        "dict use LoraConfig.from_peft(d)")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"apply_lora(seed={seed!r}): the seed must be a non-negative integer")
    plan = _plan(model, cfg, strict=True)
    trained.plan(model, cfg)  # checked before anything is installed
    _install(model, cfg, plan, _random_fill(seed))
    trained.install(model, cfg)
    return model


@jax.jit
def _merged(kernel, a, b, scale):
    """W + s_l * A_l B_l per layer, accumulated in fp32, returned in the kernel's dtype."""
    delta = jnp.einsum("lir,lro->lio", a, b, precision=jax.lax.Precision.HIGHEST)
    return (kernel.astype(jnp.float32) + scale[:, None, None] * delta).astype(kernel.dtype)


@jax.jit
def _merged_experts(kernel, a, b, scale):
    """W_e + s_l * A_e B_e per layer and expert, accumulated in fp32, returned in the kernel's dtype."""
    delta = jnp.einsum("leir,lero->leio", a, b, precision=jax.lax.Precision.HIGHEST)
    return (kernel.astype(jnp.float32) + scale[:, None, None, None] * delta).astype(kernel.dtype)


def _expert_merges(model) -> dict[tuple[str, ...], tuple]:
    """{expert kernel path: (MoE MLP, kernel attribute, ExpertLora)} for every adapted expert kernel."""
    out = {}
    for path, adapter in expert_adapters(model):
        *owner, slot = path.split(".")
        holder = _linear(model, tuple(owner))
        name = holder.LORA_KERNELS[slot]
        out[(*owner, name)] = (holder, name, adapter)
    return out


class _MergedKernels(Mapping):
    """{kernel path: merged kernel}, each computed when it is read, so a caller that moves one to host at a time
    holds one extra kernel at a time on the device."""

    def __init__(self, model):
        self._dtype = getattr(model, "dtype", None)
        self._lins = {(*tuple(p.split(".")), "kernel"): lin for p, lin in linears(model) if lin.has_lora}
        self._experts = _expert_merges(model)
        self._model = model
        self._rows = trained.row_tables(model)

    def __getitem__(self, key):
        key = tuple(key)
        if key in self._rows:
            return trained.table_with_rows(self._model, key)
        if key in self._experts:
            holder, name, ad = self._experts[key]
            # 4-bit experts merge into their dequantised weights (in the model's dtype, as for a 4-bit linear).
            return _merged_experts(expert_weight(getattr(holder, name), self._dtype), ad.lora_a[...], ad.lora_b[...],
                                   ad.lora_scale[...])
        lin = self._lins[key]
        # A 4-bit linear merges into its dequantised weight (in the model's dtype, as bitsandbytes computes it).
        kernel, a, b, scale = lin.frozen_kernel(self._dtype), lin.lora_a[...], lin.lora_b[...], lin.lora_scale[...]
        if a.ndim == 2:  # a linear outside any stack (the vision merger): one "layer"
            return _merged(kernel[None], a[None], b[None], scale[None])[0]
        return _merged(kernel, a, b, scale)

    def __iter__(self):
        return iter([*self._lins, *self._experts, *self._rows])

    def __len__(self):
        return len(self._lins) + len(self._experts) + len(self._rows)


def merged_kernels(model) -> Mapping[tuple[str, ...], jax.Array]:
    """{("layers", "attn", "q_proj", "kernel"): W + s*A@B (per layer, kernel dtype)} for every Linear with LoRA,
    {("layers", "mlp", "gate_up_proj"): W_e + s*A_e@B_e (per layer and expert)} for every adapted expert kernel,
    and {("embed", "embedding"): the table with its trained token rows} for a table that has them.

    The model is not modified (what `save_pretrained` exports). Values are computed on access.
    """
    return _MergedKernels(model)


def merge_lora(model):
    """Folds every adapter into its kernel (W <- W + s*A@B), and trained tables and rows into the base
    (`jaxft.lora.trained.merge`), and removes the adapters; in place, returns model."""
    merged = merged_kernels(model)
    experts = _expert_merges(model)
    for key, (holder, name, *_) in experts.items():
        if isinstance(getattr(holder, name), QuantizedExperts):
            raise ValueError(f"merge_lora: {'.'.join(key)} holds {getattr(holder, name).kind} experts; merging would "
                             "need re-quantising "
                             "them. Export the merged model with jaxft.save_pretrained (dequantised), or keep the "
                             "adapter separate (save_adapter)")
    for key in [k for k in merged if k not in trained.row_tables(model)]:
        quant = None if key in experts else _linear(model, key[:-1]).quant
        if quant is not None:
            kind = "an FP8" if isinstance(quant, QuantFp8) else "a 4-bit"
            raise ValueError(f"merge_lora: {'.'.join(key[:-1])} is {kind} linear; merging would need re-quantising "
                             "it. Export the merged model with jaxft.save_pretrained (dequantised), or keep the "
                             "adapter separate (save_adapter)")
    values = {key: merged[key] for key in experts}  # every expert kernel before any adapter is removed
    for key in [k for k in merged if k not in trained.row_tables(model)]:  # the tables: trained.merge
        if key in experts:
            holder, name = experts[key][:2]
            getattr(holder, name)[...] = values[key]
            continue
        lin = _linear(model, key[:-1])
        lin.kernel[...] = merged[key]
        lin.lora_a = lin.lora_b = lin.lora_scale = lin.lora_rank = nnx.static(None)
        lin.lora_dropout = 0.0
    for path, _ in expert_adapters(model):
        *owner, slot = path.split(".")
        setattr(_linear(model, tuple(owner)), slot, None)
    trained.merge(model)
    model.lora_config = None
    return model


def lora_state(model) -> nnx.State:
    """What training updates (`TrainableParam` variables: adapter matrices, trained tables and rows) of `model`."""
    return nnx.state(model, TrainableParam)


