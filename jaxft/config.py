"""Frozen, typed model configuration with lossless conversion from and to Hugging Face `config.json`.

`ModelConfig` holds the sizes and the per-layer choices (window, RoPE kind) of a decoder. What a family's
config.json keys mean, and which parts its layers are made of, lives with the family
(`jaxft.families.<name>`): `from_hf` / `to_hf` read the keys every family shares here and hand the
rest to the family's mapping.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jaxft.errors import ConfigError
from jaxft.families import family_for
from jaxft.rope_config import RopeConfig

ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")
LAYER_MLPS = ("glu", "moe", "gpt_oss_moe")  # a layer's MLP: dense gated (`glu`) or mixture of experts (`moe`; GPT-OSS's
# biased one, `gpt_oss_moe`), see jaxft.models.parts.MLPS
SPARSE_MLPS = ("moe", "gpt_oss_moe")  # the kinds with a router (num_experts, router statistics)
LAYER_ROPES = ("global", "local")  # which RoPE table a layer uses: `rope`, or `rope_local` (Gemma 3 sliding layers)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder.

    Per layer i: `layer_windows[i]` is its sliding window (None = full attention; key u is kept for query t
    iff t - u < window, as transformers' sliding masks) and `layer_ropes[i]` its RoPE table ("global": `rope`,
    "local": `rope_local`). Attention scores are `attn_scale * q.k`, soft-capped as c * tanh(s / c) when
    `attn_logit_softcap` = c; the LM logits likewise with `final_logit_softcap`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5 (Gemma); None: head_dim
    rope_local: RopeConfig | None = None
    layer_ropes: tuple[str, ...] = ()
    # Per layer i, `layer_mlps[i]` is its MLP kind ("glu": dense of width `intermediate_size`, "moe": the
    # sparse block below); default: the family's kind on every layer (Qwen3-MoE's `mlp_only_layers` /
    # `decoder_sparse_step` make some layers dense).
    layer_mlps: tuple[str, ...] = ()
    # Mixture of experts (0 experts: a dense MLP): every "moe" layer routes each token to `num_experts_per_tok` of
    # `num_experts` experts of width `moe_intermediate_size`, weighted by their router probabilities
    # (renormalised over the chosen ones when `norm_topk_prob`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # The router load-balancing loss (transformers' `load_balancing_loss_func`) times this coefficient is added
    # to the training loss; None: not added (config.json's output_router_logits false).
    router_aux_loss_coef: float | None = None
    # GPT-OSS: a learned per-head logit joined to every attention softmax's denominator (`attention_sinks`), and
    # the experts' clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up in [-limit, limit].
    attention_sinks: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Multimodal RoPE (Qwen2-VL): widths, in rotated pairs, of the chunks of each head turned by the t, h, w
    # position rows (sum = head_dim / 2); () is plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # The vision tower (a `jaxft.models.vision.VisionConfig`) of a vision-language model; None: text only.
    vision: Any = None
    # The source config.json, kept so that `to_hf` round-trips keys jaxft does not model (token ids, ...).
    hf_json: str = dataclasses.field(default="{}", compare=False, repr=False)

    def __post_init__(self):
        family_for(self.model_type)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported by jaxft's decoder; "
                              f"supported: {', '.join(ACTIVATIONS)}")
        for rope in (self.rope, self.rope_local):
            if rope is not None and rope.partial_rotary_factor != 1.0:
                # transformers' classes of every supported family rotate all head dims (the default RoPE
                # ignores the factor, the scaled kinds would build tables of the wrong width).
                raise ConfigError(
                    f"partial_rotary_factor={rope.partial_rotary_factor} is not supported by family "
                    f"{self.model_type!r} (transformers rotates every head dim there); remove it from config.json")
        for key in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, key)
            if value is not None and not float(value) > 0:
                raise ConfigError(f"{key} must be None or > 0, got {value!r}")
        if self.rope_local is None and set(self.layer_ropes) == {"global"}:
            # One RoPE for every layer is the default, not a per-layer choice: it follows num_layers (e.g. through
            # dataclasses.replace(cfg, num_layers=...)).
            object.__setattr__(self, "layer_ropes", ())
        main_mlp = family_for(self.model_type).parts.mlp
        if set(self.layer_mlps) == {main_mlp}:
            object.__setattr__(self, "layer_mlps", ())  # the default, like layer_ropes: it follows num_layers
        for key, default in (("layer_windows", None), ("layer_ropes", "global"), ("layer_mlps", main_mlp)):
            if not getattr(self, key):
                object.__setattr__(self, key, (default,) * self.num_layers)
            if len(getattr(self, key)) != self.num_layers:
                raise ConfigError(
                    f"layer_types/{key} has {len(getattr(self, key))} entries but num_hidden_layers is "
                    f"{self.num_layers}"
                )
        if self.num_experts:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                    raise ConfigError(f"{key} must be a positive integer for a mixture-of-experts model, got "
                                      f"{getattr(self, key)!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts "
                                  f"({self.num_experts})")
        coef = self.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0
                                 or coef == float("inf") or not self.num_experts):
            raise ConfigError(f"router_aux_loss_coef={coef!r} must be a finite number >= 0 on a mixture-of-experts "
                              "model (or output_router_logits: false)")
        for key in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{key}={value!r} must be a finite number > 0")
        bad = sorted(set(self.layer_mlps) - set(LAYER_MLPS))
        if bad:
            raise ConfigError(f"layer_mlps has {bad}; each entry must be one of {LAYER_MLPS}")
        if main_mlp not in self.layer_mlps:
            raise ConfigError(f"no layer of this {self.model_type} model has its family's {main_mlp!r} MLP (layer_mlps="
                              f"{list(self.layer_mlps)}); a model whose layers are all dense is a dense model: use "
                              "its dense model_type")
        if set(SPARSE_MLPS) & set(self.layer_mlps) and not self.num_experts:
            raise ConfigError("layer_mlps has sparse ('moe') layers but num_experts is 0; set num_experts in config.json")
        if self.mrope_section and sum(self.mrope_section) != self.head_dim // 2:
            raise ConfigError(f"rope_parameters.mrope_section={list(self.mrope_section)} must sum to head_dim / 2 = "
                              f"{self.head_dim // 2}")
        bad = sorted(set(self.layer_ropes) - set(LAYER_ROPES))
        if bad:
            raise ConfigError(f"layer_ropes has {bad}; each entry must be one of {LAYER_ROPES}")
        if "local" in self.layer_ropes and self.rope_local is None:
            raise ConfigError("layer_ropes uses 'local' but rope_local is not set (rope_local_base_freq)")

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for(self, kind: str) -> RopeConfig:
        """The RoPE parameters of a layer kind ("global" or "local")."""
        return self.rope_local if kind == "local" else self.rope

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Builds a config from a transformers `config.json` dict. `source` names the file in errors."""
        model_type = hf.get("model_type")
        try:
            family = family_for(model_type)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

        hf_all, hf = hf, (family.text_config(hf) if family.text_config else hf)  # a VLM's text keys

        def need(key):
            if hf.get(key) is None:
                raise ConfigError(f"{source}: required key {key!r} is missing for model_type={model_type!r}")
            return hf[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        try:
            kw: dict[str, Any] = dict(
                model_type=model_type,
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(need("intermediate_size")),
                num_layers=int(need("num_hidden_layers")),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                hidden_act=hf.get("hidden_act", "silu"),
                hf_json=json.dumps(dict(hf_all), sort_keys=True, default=str),
            )
            kw.update(family.config_from_hf(hf_all, kw))
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        out = json.loads(self.hf_json)
        for stale in ("rope_scaling", "rope_theta", "torch_dtype", "dtype", "transformers_version"):
            out.pop(stale, None)
        out.update(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope.to_hf(), tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
        )
        family = family_for(self.model_type)
        family.config_to_hf(self, out)
        out.setdefault("architectures", [family.architecture])
        return out

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def first_layers(self, n: int) -> "ModelConfig":
        """The config of the model made of this one's first `n` layers (the per-layer windows, RoPE kinds and MLP
        kinds cut; widths, embeddings and head as they are): what `remat: auto` compiles shallow copies of to
        measure per-layer memory. Raises ConfigError when those layers make no valid model of this family (a
        mixture-of-experts model whose first layers are all dense)."""
        if not 1 <= n <= self.num_layers:
            raise ConfigError(f"first_layers({n!r}) must keep between 1 and num_layers ({self.num_layers}) layers")
        return self.replace(num_layers=n, layer_windows=self.layer_windows[:n], layer_ropes=self.layer_ropes[:n],
                            layer_mlps=self.layer_mlps[:n])

    def num_params(self) -> int:
        """Parameter count of the base model (embeddings included)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        norms = 4 if family_for(self.model_type).parts.sandwich_norms else 2
        e, m = self.num_experts, self.moe_intermediate_size
        mlp = {"glu": 3 * h * i, "moe": h * e * (1 + 3 * m),
               # GPT-OSS: biased router, fused gate/up and down experts with biases
               "gpt_oss_moe": h * e * (1 + 3 * m) + e + e * (3 * m + h)}
        if self.attention_sinks:  # GPT-OSS: sinks and q/k/v/o biases
            attn += self.num_heads + d * (self.num_heads + 2 * self.num_kv_heads) + h
        per_layer = attn + norms * h + (2 * d if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return (self.vocab_size * h + head + h + self.num_layers * per_layer
                + sum(mlp[kind] for kind in self.layer_mlps))
