"""Flax NNX decoders (Llama, Mistral, Qwen2, Qwen3 dense)."""

from jaxft.models.decoder import Decoder, abstract_model, init_model, positions_from_segments
from jaxft.models.layers import Linear, LoraParam, LoraRank, LoraScale, RMSNorm, linears

__all__ = ["Decoder", "Linear", "LoraParam", "LoraRank", "LoraScale", "RMSNorm", "abstract_model", "init_model",
           "linears", "positions_from_segments"]
