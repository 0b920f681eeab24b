"""A Hugging Face Llama-family model with the specache agent holding its KV cache.

    import specache.transformers
    out = specache.transformers.generate(model, input_ids, kv="specache", max_new_tokens=64)

generate() runs the method's loop (docs/method.md) with the model's own layers: prefill, the
pre-decode step and the two-row decode steps (the real token and the speculative one), greedy.
The model's attention is the function registered under ATTENTION_NAME with transformers'
AttentionInterface; its KV cache is a SpecacheCache, which keeps no tensors (the agent does:
a low-bit replica, and the full precision in an InMemorySource or specached's pages).
"""

from .attention import ATTENTION_NAME, specache_attention
from .cache import SpecacheCache
from .generate import generate, kv_config, model_shape

__all__ = ["ATTENTION_NAME", "SpecacheCache", "generate", "kv_config", "model_shape", "specache_attention"]
