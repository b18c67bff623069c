"""Vision towers feeding the decoder's `inputs_embeds` (Qwen2-VL, Qwen2.5-VL)."""

from jaxft.models.vision.layout import PatchLayout, patch_layout
from jaxft.models.vision.targets import finetune_targets
from jaxft.models.vision.tower import VisionTower
from jaxft.vision_config import VisionConfig

__all__ = ["PatchLayout", "VisionConfig", "VisionTower", "finetune_targets", "patch_layout"]
