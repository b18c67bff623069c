"""The vision half of a Qwen2-VL / Qwen2.5-VL config.json: tower sizes, merger, image token ids.

Two towers share one config type (`kind`):
- "qwen2_vl":   LayerNorm (with bias) blocks, fc1 -> `hidden_act` (quick_gelu) -> fc2 MLP of width
                embed_dim * mlp_ratio, LayerNorm before the merger; every block attends over a whole image.
- "qwen2_5_vl": RMSNorm blocks, SwiGLU MLP (gate/up/down, biased) of width `intermediate_size`, RMSNorm before
                the merger; blocks attend inside windows of `window_size` pixels except `fullatt_block_indexes`.
Both: a patch is `in_channels x temporal_patch_size x patch_size x patch_size` pixels (the processor's
flattening), heads of embed_dim / num_heads dims with 2-D (h, w) RoPE of base `rope_theta`, and a merger that
concatenates `spatial_merge_size`^2 neighbouring patches and projects them to the text width `out_hidden_size`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxft.errors import ConfigError

KINDS = ("qwen2_vl", "qwen2_5_vl")
VISION_ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Frozen sizes of a Qwen2(-.5)-VL vision tower plus the token ids that place its output in the text."""

    kind: str
    depth: int
    embed_dim: int  # the tower's width (2-VL `embed_dim`, 2.5-VL `hidden_size`)
    num_heads: int
    mlp_dim: int  # MLP width (2-VL embed_dim * mlp_ratio, 2.5-VL intermediate_size)
    out_hidden_size: int  # the merger's output width: the text model's hidden_size
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    window_size: int = 0  # 2.5-VL: window side in pixels (0: no windows)
    fullatt_block_indexes: tuple[int, ...] = ()
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"vision kind {self.kind!r} is not supported; supported: {', '.join(KINDS)}")
        for key in ("depth", "embed_dim", "num_heads", "mlp_dim", "out_hidden_size", "in_channels", "patch_size",
                    "temporal_patch_size", "spatial_merge_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"vision_config.{key} must be a positive integer, got {value!r}")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ConfigError(f"vision_config: embed_dim ({self.embed_dim}) / num_heads ({self.num_heads}) must be a "
                              "multiple of 4 (2-D RoPE splits each head into h and w halves of rotated pairs)")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act={self.hidden_act!r} is not supported; supported: "
                              f"{', '.join(VISION_ACTIVATIONS)}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"vision_config.fullatt_block_indexes has {bad}, outside the {self.depth} blocks")
        if self.kind == "qwen2_5_vl" and self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ConfigError(
                f"vision_config.window_size={self.window_size} must be a positive multiple of patch_size * "
                f"spatial_merge_size = {self.patch_size * self.spatial_merge_size}")
        if self.kind == "qwen2_5_vl" and not self.window_size:
            raise ConfigError("vision_config.window_size must be > 0 for qwen2_5_vl")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixels per patch: the length of one row of the processor's `pixel_values`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def window_units(self) -> int:
        """Window side in merged tokens (2.5-VL); 0 without windows."""
        return self.window_size // self.spatial_merge_size // self.patch_size if self.window_size else 0

    def full_attention(self, block: int) -> bool:
        return self.kind == "qwen2_vl" or block in self.fullatt_block_indexes

    @classmethod
    def from_hf(cls, kind: str, hf: Mapping[str, Any]) -> "VisionConfig":
        """From a config.json dict: its `vision_config` and the top-level token ids."""
        v = hf.get("vision_config")
        if not isinstance(v, Mapping):
            raise ConfigError(f"required key 'vision_config' (an object) is missing for model_type={kind!r}")
        theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
        common = dict(kind=kind, depth=int(v.get("depth", 32)), num_heads=int(v.get("num_heads", 16)),
                      in_channels=int(v.get("in_channels", 3)), patch_size=int(v.get("patch_size", 14)),
                      temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                      spatial_merge_size=int(v.get("spatial_merge_size", 2)), rope_theta=float(theta),
                      image_token_id=int(hf.get("image_token_id", 151655)),
                      video_token_id=int(hf.get("video_token_id", 151656)),
                      vision_start_token_id=int(hf.get("vision_start_token_id", 151652)))
        if kind == "qwen2_vl":
            embed = int(v.get("embed_dim", 1280))
            return cls(embed_dim=embed, mlp_dim=int(embed * v.get("mlp_ratio", 4)),
                       out_hidden_size=int(v.get("hidden_size", 3584)), hidden_act=v.get("hidden_act", "quick_gelu"),
                       **common)
        return cls(embed_dim=int(v.get("hidden_size", 3584)), mlp_dim=int(v.get("intermediate_size", 3420)),
                   out_hidden_size=int(v.get("out_hidden_size", 3584)), hidden_act=v.get("hidden_act", "silu"),
                   window_size=int(v.get("window_size", 112)),
                   fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
                   **common)

    def to_hf(self, source: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The `vision_config` object (keys of `source`'s vision_config that jaxft does not model are kept)."""
        out = dict(source or {})
        out.update(depth=self.depth, num_heads=self.num_heads, in_channels=self.in_channels,
                   patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                   spatial_merge_size=self.spatial_merge_size, hidden_act=self.hidden_act,
                   rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        out.pop("rope_theta", None)
        if self.kind == "qwen2_vl":
            if self.mlp_dim % self.embed_dim:
                raise ConfigError(f"vision mlp_dim {self.mlp_dim} is not a multiple of embed_dim {self.embed_dim}")
            out.update(model_type="qwen2_vl_vision", embed_dim=self.embed_dim, hidden_size=self.out_hidden_size,
                       mlp_ratio=self.mlp_dim // self.embed_dim)
        else:
            out.update(model_type="qwen2_5_vl_vision", hidden_size=self.embed_dim, intermediate_size=self.mlp_dim,
                       out_hidden_size=self.out_hidden_size, window_size=self.window_size,
                       fullatt_block_indexes=list(self.fullatt_block_indexes))
        return out
