"""4-bit frozen weights in bitsandbytes' format (QLoRA): the quantiser (`blockwise`), the settings (`config`,
with `Fp8Config` for an FP8 base); `jaxft.quant.weights` and `jaxft.quant.fp8` turn a model's linears into 4-bit
and FP8 ones (they import the models, so they are not re-exported here: `jaxft.models.layers` imports this
package)."""

from jaxft.quant.blockwise import (BLOCKSIZES, NESTED_ROUNDINGS, Quantized4bit, dequantize_absmax, double_quantize,
                                   quantize_4bit, quantize_blockwise_8bit)
from jaxft.quant.config import DEFAULT_SKIP, Fp8Config, QuantConfig, QuantConfigError, is_skipped

__all__ = ["BLOCKSIZES", "DEFAULT_SKIP", "Fp8Config", "NESTED_ROUNDINGS", "QuantConfig", "QuantConfigError",
           "Quantized4bit", "dequantize_absmax", "double_quantize", "is_skipped", "quantize_4bit",
           "quantize_blockwise_8bit"]
