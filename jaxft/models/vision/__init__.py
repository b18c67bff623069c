"""Vision towers feeding the decoder's `inputs_embeds` (Qwen2-VL, Qwen2.5-VL)."""

from jaxft.vision_config import VisionConfig
from jaxft.models.vision.layout import PatchLayout, patch_layout
from jaxft.models.vision.targets import finetune_targets
from jaxft.models.vision.tower import VisionTower

__all__ = ["PatchLayout", "VisionConfig", "VisionTower", "finetune_targets", "patch_layout"]
