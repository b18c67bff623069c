"""4-bit frozen weights in bitsandbytes' format (QLoRA): the quantiser (`blockwise`), the settings (`config`);
`jaxft.quant.weights` turns a model's linears into 4-bit ones (it imports the models, so it is not
re-exported here: `jaxft.models.layers` imports this package)."""

from jaxft.quant.blockwise import (BLOCKSIZES, NESTED_ROUNDINGS, Quantized4bit, dequantize_absmax, double_quantize,
                                   quantize_4bit, quantize_blockwise_8bit)
from jaxft.quant.config import DEFAULT_SKIP, QuantConfig, QuantConfigError, is_skipped

__all__ = ["BLOCKSIZES", "DEFAULT_SKIP", "NESTED_ROUNDINGS", "QuantConfig", "QuantConfigError", "Quantized4bit", "dequantize_absmax",
           "double_quantize", "is_skipped", "quantize_4bit", "quantize_blockwise_8bit"]
