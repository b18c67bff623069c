"""Flax NNX decoders assembled per family (Llama, Mistral, Qwen2, Qwen3 dense, Gemma 2, Gemma 3 text)."""

from jaxft.families import FAMILIES, BlockParts, Family, family_for
from jaxft.models.build import abstract_model, init_model
from jaxft.models.decoder import Decoder, positions_from_segments
from jaxft.models.layers import Linear, LoraParam, LoraRank, LoraScale, QuantizedWeight, linears
from jaxft.models.parts import RMSNorm

__all__ = ["FAMILIES", "BlockParts", "Decoder", "Family", "Linear", "LoraParam", "LoraRank", "LoraScale",
           "QuantizedWeight", "RMSNorm", "abstract_model", "family_for", "init_model", "linears",
           "positions_from_segments"]
