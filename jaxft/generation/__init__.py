"""Text generation with a KV cache: `generate` (strings or chats in, completions out) and `generate_ids`.

See `engine` for the compiled prefill + decode loop and the shape buckets, `kv_cache` for the cached
forward pass, `sampling` for greedy / top-p sampling, `text` for prompt rendering (chats with images
included) and stop tokens.
"""

from jaxft.generation.engine import (Generation, GenerationError, PromptImages, generate_ids, model_stop_ids,
                                     run_generation)
from jaxft.generation.text import (decode_completion, encode_prompt, encode_prompt_images, generate,
                                   normalize_prompts, stop_ids)

__all__ = ["Generation", "GenerationError", "PromptImages", "decode_completion", "encode_prompt",
           "encode_prompt_images", "generate", "generate_ids", "model_stop_ids", "normalize_prompts",
           "run_generation", "stop_ids"]
