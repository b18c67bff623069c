"""4-bit frozen weights in bitsandbytes' format (QLoRA): the quantiser (`blockwise`), the model transform and
the variable types (`weights`)."""

from jaxft.quant.blockwise import (BLOCKSIZES, NESTED_ROUNDINGS, Quantized4bit, dequantize_absmax, double_quantize,
                                   quantize_4bit, quantize_blockwise_8bit)

__all__ = ["BLOCKSIZES", "NESTED_ROUNDINGS", "Quantized4bit", "dequantize_absmax", "double_quantize",
           "quantize_4bit", "quantize_blockwise_8bit"]
