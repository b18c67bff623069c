"""Workload definitions shared by every system of the training benchmark.

Everything a worker needs to train "the same thing" lives here, or in the two modules this one re-exports (all of
it importable from here), and nowhere else:

* the model shapes (Hugging Face config dicts of the real models; weights are random): shapes.py,
* the workloads (shape x batch x sequence length x packing),
* the LoRA and optimizer settings,
* the token data (seeded numpy, identical for every system; checked by a SHA-256): token_data.py,
* the useful-FLOP formula used for MFU.

Useful FLOPs of one optimizer step (the formula printed in every report):

    useful = tokens * (4 * P_frozen + 6 * P_lora) + 12 * L * H_q * D * pairs  [+ vision, below]

* ``P_frozen``: parameters of the frozen matmuls a token runs through (q, k, v, o, gate, up, down of
  every layer plus the lm_head; the embedding lookup is not a matmul). Forward costs 2 FLOPs per
  parameter and token, backward 2 more for the input gradient; the frozen weights get no weight
  gradient. A mixture-of-experts layer counts its router (hidden x experts) and the top-k experts a
  token is routed to (gate_up hidden x 2I, down I x hidden), not all of them: those are the FLOPs
  that run.
* ``P_lora``: LoRA parameters a token runs through (r * (in + out) per adapted linear; expert LoRA,
  PEFT's ``target_parameters``: the top-k experts' factors): forward 2, input gradient 2, weight
  gradient 2. The trainable count (``param_counts(...)["lora"]``, checked against every system's)
  holds every expert's factors.
* vision-language shapes add the vision tower's FORWARD only (its weights are frozen and nothing
  trainable is upstream of it, so no system runs its backward): 2 FLOPs per matmul parameter per
  patch (patch embedding, blocks) and per merged token (the merger), plus 4 * D_v per (query, key)
  pair and head of its bidirectional attention (window blocks: pairs within a window; full blocks:
  within an image). ``tokens`` are text + image tokens (the language model runs on both).
* attention: per layer and head, QK^T and PV cost 2 * D FLOPs per (query, key) pair each in the
  forward (4 * D), the backward twice that, so 12 * D per pair. ``pairs`` counts the causal
  (query, key) pairs that are allowed, diagonal included: T (T + 1) / 2 for a plain row, and the
  sum of n (n + 1) / 2 over the documents of a packed row (cross-document pairs are not useful).
* DPO workloads add the reference model's forward (no gradient) over the same tokens: 2 * P_frozen per
  token and 4 * D per pair and head (the reference is the base model: its LoRA FLOPs are not useful).
* Full fine-tuning systems (every weight trained): the matmul weights get their weight gradient too, so
  6 * P_frozen per token and no LoRA term; their trainable count is every parameter of the model.
* Not counted: norms, activations, softmax, the loss, recomputation by gradient checkpointing.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

from .shapes import SHAPES, ModelShape
from .token_data import (IMAGE_TEXT_PREFIX, PACKED_DOC_SIGMA, PACKED_MIN_DOC, TokenData, causal_pairs,
                              image_processor, make_token_data, preference_sha256, synthetic_image,
                              text_vocab_below)

__all__ = [
    # the training settings
    "LORA_TARGETS", "EXPERT_TARGETS", "LoraSettings", "AdamWSettings", "LORA", "ADAMW",
    # bench.shapes
    "ModelShape", "SHAPES",
    # the workloads
    "Workload", "WORKLOADS", "DEFAULT_WORKLOADS", "TINY_WORKLOADS", "DPO_BETA", "DPO_LOSS_TYPE", "get_workload",
    # bench.token_data
    "PACKED_DOC_SIGMA", "PACKED_MIN_DOC", "IMAGE_TEXT_PREFIX", "TokenData", "image_processor", "synthetic_image",
    "text_vocab_below", "causal_pairs", "make_token_data", "preference_sha256",
    # FLOPs
    "FLOP_FORMULA", "MoeLayout", "moe_layout", "linear_shapes", "ATTENTION_TARGETS", "lora_module_targets",
    "expert_shapes", "param_counts", "vision_params", "vision_attention_pairs", "useful_flops",
]

# --------------------------------------------------------------------------------------------
# Training settings shared by every system.
# --------------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Mixture-of-experts MLPs have no Linear modules: their experts are raw [E, ., .] parameters that LoRA adapts
# through PEFT's target_parameters (jaxft: lora_target_parameters; Unsloth derives the same two from gate/up/down).
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA on every target linear: y = W x + (alpha / r) * B (A x); dropout off, no bias."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    expert_targets: tuple[str, ...] = EXPERT_TARGETS  # on MoE shapes only

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0:
            raise ValueError(f"LoraSettings: r={self.r} and alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings: dropout={self.dropout} must be in [0, 1)")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"LoraSettings: unknown targets {sorted(unknown)}; known {LORA_TARGETS}")
        unknown = set(self.expert_targets) - set(EXPERT_TARGETS)
        if unknown:
            raise ValueError(f"LoraSettings: unknown expert_targets {sorted(unknown)}; known {EXPERT_TARGETS}")


@dataclasses.dataclass(frozen=True)
class AdamWSettings:
    """AdamW (decoupled weight decay) on the LoRA parameters only, constant learning rate.

    Note optax.adamw defaults to weight_decay=1e-4; torch.optim.AdamW to 1e-2: pass 0.0 explicitly.
    """

    lr: float = 1e-4
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or not (0 <= self.b1 < 1 and 0 <= self.b2 < 1) or self.eps <= 0:
            raise ValueError(f"AdamWSettings: invalid {self}")


LORA = LoraSettings()
ADAMW = AdamWSettings()
# The DPO objective of every DPO system (TRL's DPOConfig defaults, and examples/bench/dpo.yaml's keys).
DPO_BETA = 0.1
DPO_LOSS_TYPE = "sigmoid"

# --------------------------------------------------------------------------------------------
# Workloads.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark row: a model shape trained on ``batch`` rows of ``seq_len`` tokens.

    ``packed``: each row is a concatenation of documents whose lengths are lognormal with mean
    ``mean_doc_len`` (the last one cut to fill the row; no padding), positions restart at 0 per
    document and no attention or loss crosses a document boundary.
    ``image_size``: (vision-language shapes) each row holds one synthetic ``image_size`` x ``image_size``
    image (seeded noise) after a short text prefix, its image tokens and then text to ``seq_len``
    tokens in all (text + image tokens); the image tokens carry no loss.
    ``dpo``: each step trains ``batch`` preference pairs; each side of a pair, prompt + chosen and prompt +
    rejected, is ``seq_len`` tokens, the shared prompt the first half (token_data.preference_prompt_len) and only
    the completion scored. jaxft lays a pair out whole in one row of ``row_len`` = 2 * seq_len tokens (two
    documents, as `jaxft.data.preference` packs pairs), TRL as two rows of ``seq_len``: the same tokens.
    """

    name: str
    shape_name: str
    batch: int
    seq_len: int
    packed: bool = False
    mean_doc_len: int = 0
    tiny: bool = False
    image_size: int = 0
    dpo: bool = False

    def __post_init__(self) -> None:
        if self.shape_name not in SHAPES:
            raise ValueError(f"Workload {self.name!r}: unknown shape {self.shape_name!r}; "
                             f"known {sorted(SHAPES)}")
        if self.batch < 1 or self.seq_len < 2:
            raise ValueError(f"Workload {self.name!r}: batch={self.batch} must be >= 1 and "
                             f"seq_len={self.seq_len} >= 2")
        if self.packed and not PACKED_MIN_DOC <= self.mean_doc_len <= self.seq_len:
            raise ValueError(f"Workload {self.name!r}: packed needs {PACKED_MIN_DOC} <= "
                             f"mean_doc_len={self.mean_doc_len} <= seq_len={self.seq_len}")
        if (self.image_size > 0) != self.shape.is_vlm or self.image_size < 0:
            raise ValueError(f"Workload {self.name!r}: image_size={self.image_size} must be > 0 exactly when "
                             f"the shape {self.shape_name!r} is a vision-language one")
        if self.image_size and self.packed:
            raise ValueError(f"Workload {self.name!r}: image rows are not packed (one chat per row)")
        if self.dpo and (self.packed or self.image_size or self.seq_len < 4):
            raise ValueError(f"Workload {self.name!r}: a DPO workload has text rows of seq_len >= 4 tokens (a prompt "
                             "and a completion of at least 2 each) and no packing of its own")

    @property
    def shape(self) -> ModelShape:
        return SHAPES[self.shape_name]

    @property
    def tokens_per_step(self) -> int:
        """Every token a step's forward runs on: with dpo, both sides of every pair."""
        return self.batch * self.row_len

    @property
    def row_len(self) -> int:
        """Tokens of one jaxft row: seq_len, or with dpo a whole pair (chosen and rejected, seq_len each)."""
        return 2 * self.seq_len if self.dpo else self.seq_len

    @property
    def seed(self) -> int:
        # Stable across processes and Python versions (hash() is salted per process).
        return zlib.crc32(self.name.encode()) & 0x7FFFFFFF

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("1b_2x4096", "llama-3.2-1b", 2, 4096),
    Workload("3b_4096", "llama-3.2-3b", 1, 4096),
    Workload("8b_4096", "llama-3.1-8b", 1, 4096),
    Workload("8b_16384", "llama-3.1-8b", 1, 16384),
    Workload("70b_4096", "llama-3.1-70b", 1, 4096),
    Workload("qwen3_8b_4096", "qwen3-8b", 1, 4096),
    Workload("8b_packed_16384", "llama-3.1-8b", 1, 16384, packed=True, mean_doc_len=300),
    # Issue #10's long rows: one row per step (its table's 32k / 64k, and packed 64k).
    Workload("8b_32768", "llama-3.1-8b", 1, 32768),
    Workload("8b_65536", "llama-3.1-8b", 1, 65536),
    Workload("8b_packed_65536", "llama-3.1-8b", 1, 65536, packed=True, mean_doc_len=300),
    Workload("gemma2_9b_4096", "gemma-2-9b", 1, 4096),
    Workload("gemma2_9b_packed_16384", "gemma-2-9b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gemma3_12b_4096", "gemma-3-12b", 1, 4096),
    Workload("gemma3_12b_packed_16384", "gemma-3-12b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gpt_oss_20b_4096", "gpt-oss-20b", 1, 4096),
    Workload("gpt_oss_20b_packed_16384", "gpt-oss-20b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("qwen3_30b_a3b_4096", "qwen3-30b-a3b", 1, 4096),
    Workload("qwen3_30b_a3b_packed_16384", "qwen3-30b-a3b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("qwen2_5_vl_7b_448", "qwen2.5-vl-7b", 1, 4096, image_size=448),
    Workload("qwen2_5_vl_7b_1024", "qwen2.5-vl-7b", 1, 4096, image_size=1024),
    # The DPO row: one pair per step, each side 2048 tokens, the prompt its first half, as TRL's DPOConfig
    # defaults (max_length 1024, max_prompt_length 512 while it had one) and Unsloth's DPO notebooks (1024 / 512).
    Workload("8b_dpo_2048", "llama-3.1-8b", 1, 2048, dpo=True),
    Workload("tiny_llama", "tiny-llama", 2, 128, tiny=True),
    Workload("tiny_qwen3_moe", "tiny-qwen3-moe", 1, 256, tiny=True),
    Workload("tiny_qwen3_moe_packed", "tiny-qwen3-moe", 1, 256, packed=True, mean_doc_len=40, tiny=True),
    Workload("tiny_qwen2_5_vl", "tiny-qwen2.5-vl", 1, 128, image_size=140, tiny=True),
    Workload("tiny_gpt_oss", "tiny-gpt-oss", 1, 256, tiny=True),
    Workload("tiny_gpt_oss_packed", "tiny-gpt-oss", 1, 256, packed=True, mean_doc_len=40, tiny=True),
    Workload("tiny_gemma2", "tiny-gemma2", 1, 128, tiny=True),
    Workload("tiny_gemma3", "tiny-gemma3", 1, 128, tiny=True),
    Workload("tiny_qwen3", "tiny-qwen3", 1, 128, tiny=True),
    Workload("tiny_packed", "tiny-llama", 1, 128, packed=True, mean_doc_len=24, tiny=True),
    Workload("tiny_dpo", "tiny-llama", 2, 64, dpo=True, tiny=True),
)}
DEFAULT_WORKLOADS = ("1b_2x4096", "8b_4096", "8b_16384", "qwen3_8b_4096", "8b_packed_16384")
TINY_WORKLOADS = ("tiny_llama", "tiny_qwen3", "tiny_packed")


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


# --------------------------------------------------------------------------------------------
# FLOPs.
# --------------------------------------------------------------------------------------------

FLOP_FORMULA = ("useful_flops/step = tokens * (4 * P_frozen + 6 * P_lora) + 12 * L * H_q * D * pairs "
                "[+ VLM: vision tower forward 2 * P_vision per patch + 4 * D_v * H_v * vision pairs]; "
                "P_frozen = frozen matmul params a token runs (q,k,v,o,gate,up,down per layer + lm_head; "
                "MoE: router + the top-k experts' gate_up/down, not all experts), "
                "P_lora = r * (in + out) per adapted linear (MoE expert LoRA: top-k experts' factors), "
                "pairs = causal within-document (query, key) pairs incl. the diagonal (T(T+1)/2 per "
                "unpacked row); VLM tokens = text + image tokens; DPO: tokens = both sides of every pair, plus "
                "the reference forward 2 * P_frozen per token + 4 * L * H_q * D per pair; full fine-tuning: "
                "6 * P_frozen per token (weight gradients too), no LoRA term; "
                "MFU = useful_flops / median_step_time / bf16 matmul ceiling measured in this run")


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """A mixture-of-experts shape: E experts of width I, top_k per token, on the layers ``sparse`` marks."""

    num_experts: int
    top_k: int
    width: int
    sparse: tuple[bool, ...]


def moe_layout(shape: ModelShape) -> MoeLayout | None:
    """The shape's experts (None for a dense model), with transformers' rule for which layers are sparse."""
    cfg, layers = shape.hf_config, shape.get("num_hidden_layers")
    if cfg["model_type"] == "gpt_oss":
        return MoeLayout(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                         (True,) * layers)
    if cfg["model_type"] == "qwen3_moe":
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        only, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step", 1)
        return MoeLayout(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                         tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers)))
    return None


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each per-layer linear of a dense layer."""
    h, i = shape.get("hidden_size"), shape.get("intermediate_size")
    q, kv = shape.get("num_attention_heads") * shape.get("head_dim"), \
        shape.get("num_key_value_heads") * shape.get("head_dim")
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_module_targets(shape: ModelShape, lora: LoraSettings = LORA) -> tuple[str, ...]:
    """The Linear modules every system adapts (PEFT target_modules): lora.targets, but on a MoE shape whose
    layers are all sparse only the attention ones. No gate/up/down_proj Linear exists there (jaxft refuses
    a target that matches nothing) and, worse, PEFT >= 0.21 on transformers 5 rewrites gate_proj/up_proj
    targets of a Qwen3-MoE into expert LoRA on the fused gate_up_proj at rank 2r and alpha 2 alpha
    (peft.utils.transformers_weight_conversion, the v4 -> v5 MoE conversion): the experts are adapted
    through target_parameters = lora.expert_targets instead, at rank r in every system."""
    moe = moe_layout(shape)
    if moe is not None and all(moe.sparse):
        return tuple(t for t in lora.targets if t in ATTENTION_TARGETS)
    return tuple(lora.targets)


def expert_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of one expert's matmuls, keyed by the PEFT target_parameters name (gate and up fused)."""
    moe = moe_layout(shape)
    h = shape.get("hidden_size")
    return {"experts.gate_up_proj": (h, 2 * moe.width), "experts.down_proj": (moe.width, h)}


def param_counts(shape: ModelShape, lora: LoraSettings = LORA) -> dict[str, int]:
    """Frozen matmul parameters and LoRA parameters of the language model.

    frozen_matmul / lora_active: what one token runs through (the FLOP basis: a MoE layer's router and
    top-k experts); stored_matmul / lora: what exists (every expert; lora is the trainable count every
    system reports). Dense shapes: active == stored.
    """
    layers = shape.get("num_hidden_layers")
    lin = linear_shapes(shape)
    attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    moe = moe_layout(shape)
    counts = dict.fromkeys(("frozen_matmul", "stored_matmul", "lora", "lora_active"), 0)
    for layer in range(layers):
        sparse = moe is not None and moe.sparse[layer]
        frozen = sum(a * b for n, (a, b) in lin.items() if n in attn)
        adapted = sum(lora.r * (a + b) for n, (a, b) in lin.items() if n in attn and n in lora.targets)
        active = stored = frozen
        lora_active = lora_stored = adapted
        if sparse:
            experts = expert_shapes(shape)
            router = shape.get("hidden_size") * moe.num_experts
            one = sum(a * b for a, b in experts.values())
            one_lora = sum(lora.r * (a + b) for n, (a, b) in experts.items() if n in lora.expert_targets)
            active += router + moe.top_k * one
            stored += router + moe.num_experts * one
            lora_active += moe.top_k * one_lora
            lora_stored += moe.num_experts * one_lora
        else:
            dense = sum(a * b for n, (a, b) in lin.items() if n in mlp)
            dense_lora = sum(lora.r * (a + b) for n, (a, b) in lin.items() if n in mlp and n in lora.targets)
            active, stored = active + dense, stored + dense
            lora_active, lora_stored = lora_active + dense_lora, lora_stored + dense_lora
        counts["frozen_matmul"] += active
        counts["stored_matmul"] += stored
        counts["lora_active"] += lora_active
        counts["lora"] += lora_stored
    head = shape.get("hidden_size") * shape.get("vocab_size")  # lm_head (tied or not)
    counts["frozen_matmul"] += head
    counts["stored_matmul"] += head
    if shape.is_vlm:
        counts.update({f"vision_{k}": v for k, v in vision_params(shape).items()})
    return {k: int(v) for k, v in counts.items()}


def vision_params(shape: ModelShape) -> dict[str, int]:
    """Matmul parameters of a Qwen2.5-VL vision tower: per patch (the patch embedding, a matmul of the
    3 * temporal * patch^2 pixel values, and every block's qkv, proj, gate, up, down) and per merged token
    (the merger's two linears over merge^2 concatenated patches)."""
    v = shape.get("vision_config")
    hv, iv = v["hidden_size"], v["intermediate_size"]
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    block = hv * 3 * hv + hv * hv + 2 * hv * iv + iv * hv
    merged = hv * v["spatial_merge_size"] ** 2
    return {"per_patch": patch_in * hv + v["depth"] * block,
            "per_merged": merged * merged + merged * v["out_hidden_size"]}


def vision_attention_pairs(shape: ModelShape, grid: tuple[int, int, int]) -> dict[str, int]:
    """(query, key) pairs of one image in the tower's attention, per block kind: a full-attention block attends
    within the image (N^2 for N patches), a window block within windows of window_size pixels on the merged
    grid (edge windows partial), as transformers' Qwen2_5_VisionTransformer.get_window_index cuts them."""
    v = shape.get("vision_config")
    m = v["spatial_merge_size"]
    t, h, w = grid
    win = v["window_size"] // m // v["patch_size"]  # window side in merged tokens
    hm, wm = h // m, w // m
    sides_h = [min(win, hm - a) for a in range(0, hm, win)]
    sides_w = [min(win, wm - a) for a in range(0, wm, win)]
    window = t * sum((a * b * m * m) ** 2 for a in sides_h for b in sides_w)
    return {"full": (t * h * w) ** 2, "window": window}


def useful_flops(shape: ModelShape, tokens: int, pairs: int, lora: LoraSettings = LORA,
                 image_grids: list[tuple[int, int, int]] | tuple = (), reference_forward: bool = False,
                 full: bool = False) -> float:
    """Useful FLOPs of one optimizer step (see the module docstring and FLOP_FORMULA); `reference_forward`: a
    DPO step's forward of the reference (the base model) over the same tokens; `full`: a full fine-tune (every
    matmul weight gets its gradient, no adapters)."""
    p = param_counts(shape, lora)
    per_pair = shape.get("num_hidden_layers") * shape.get("num_attention_heads") * shape.get("head_dim") * pairs
    if full:
        per_token = 6 * p["frozen_matmul"]
    else:
        per_token = (6 if reference_forward else 4) * p["frozen_matmul"] + 6 * p["lora_active"]
    flops = float(tokens) * per_token + float((16 if reference_forward else 12) * per_pair)
    if image_grids:
        v = shape.get("vision_config")
        full_blocks = len(v["fullatt_block_indexes"])
        head_dim = v["hidden_size"] // v["num_heads"]
        for grid in image_grids:
            patches = grid[0] * grid[1] * grid[2]
            vp = vision_attention_pairs(shape, grid)
            flops += 2.0 * (p["vision_per_patch"] * patches
                            + p["vision_per_merged"] * patches // v["spatial_merge_size"] ** 2)
            pairs_per_head = full_blocks * vp["full"] + (v["depth"] - full_blocks) * vp["window"]
            flops += 4.0 * head_dim * v["num_heads"] * pairs_per_head
    return flops
