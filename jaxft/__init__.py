"""jaxft: fast, memory-lean LoRA fine-tuning of Hugging Face LLMs in JAX.

Public API:
    from_pretrained(path, dtype="bfloat16", quantize=None) -> model  (quantize="nf4"/"fp4": QLoRA's 4-bit base;
                                                             "fp8": an FP8 base, FP8 GEMMs on Ada/Hopper)
        model(input_ids, positions=None, segment_ids=None)
    save_pretrained(model, path)                           (LoRA merged)
    save_gguf(model, path, dtype="f16", tokenizer=...)    one GGUF file for llama.cpp (LoRA merged; q8_0, ...)
    apply_lora(model, LoraConfig(...)), merge_lora(model)
    save_adapter(model, dir), load_adapter(model, dir)     (PEFT format)
    generate(model, tokenizer, prompts, ...)               (KV-cached decoding)
    ExecutionConfig(...)                                   how a forward/step runs (kernels, remat, layer loop)
    Run(...) / Run.from_config(train_config, steps)        the training recipe (jaxft.run)
    claim_gpu_memory()                                     before anything touches a device: JAX's allocator may
                                                           take 95% of each GPU, as jaxft-train lets it (JAX: 75%)
"""

from jaxft.memory import claim_gpu_memory
from jaxft.config import ModelConfig
from jaxft.errors import ConfigError
from jaxft.memory.execution import ExecutionConfig
from jaxft.generation import generate
from jaxft.io import from_pretrained, save_gguf, save_pretrained
from jaxft.lora import LoraConfig, apply_lora, load_adapter, merge_lora, save_adapter
from jaxft.models import Decoder, LoraParam, init_model
from jaxft.quant import Fp8Config, QuantConfig
from jaxft.rope_config import RopeConfig
from jaxft.run import Run

__all__ = [
    "ConfigError",
    "Decoder",
    "ExecutionConfig",
    "Fp8Config",
    "LoraConfig",
    "LoraParam",
    "ModelConfig",
    "QuantConfig",
    "RopeConfig",
    "Run",
    "apply_lora",
    "claim_gpu_memory",
    "from_pretrained",
    "generate",
    "init_model",
    "load_adapter",
    "merge_lora",
    "save_adapter",
    "save_gguf",
    "save_pretrained",
]
