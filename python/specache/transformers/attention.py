"""The attention function transformers calls in every layer while SpecacheCache.active() holds.

Registered as "specache" with transformers' AttentionInterface (and given no mask function: the
agent applies causality itself). transformers calls it with the layer's query, key and value after
RoPE, [batch, heads, rows, head_dim], and the value SpecacheCache.update returned for key and
value, which is this step's rows unchanged. Those rows go to the agent (prefill or decode, per
the cache's phase), whose output is returned as [batch, rows, heads, head_dim].
"""

import torch
from transformers import AttentionInterface

from .cache import active_cache

ATTENTION_NAME = "specache"


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [batch, heads, rows, head_dim] -> [batch, rows, heads, head_dim], float32, contiguous: the
    # agent's layout. A copy only where the layout or dtype differs (always for q, k, v coming out
    # of transformers' transposed views); the agent then works in place on it.
    return t.transpose(1, 2).to(torch.float32).contiguous()


def specache_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = active_cache()
    if cache is None:
        raise RuntimeError(
            "the specache attention runs only inside specache.transformers.generate "
            "(or a SpecacheCache.active() block)"
        )
    head_dim = query.shape[-1]
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-6 * head_dim**-0.5:
        raise ValueError(f"specache attention scales by 1/sqrt(head_dim); the model asks for {scaling}")
    if dropout:
        raise ValueError("specache attention is for inference: dropout must be 0")
    # What the agent's attention does not do: it attends over the whole context, uncapped.
    for option in ("softcap", "s_aux"):
        if kwargs.get(option) is not None:
            raise NotImplementedError(f"specache attention has no {option} (this model's attention asks for it)")
    window = kwargs.get("sliding_window")
    if window is not None and cache.longest_context(query.shape[2]) > window:
        raise NotImplementedError(
            f"specache attention attends over the whole context; this layer's sliding window is {window} tokens"
        )
    if key.shape[2] != query.shape[2]:
        raise RuntimeError(
            f"specache attention got {key.shape[2]} key rows for {query.shape[2]} query rows: the model "
            "is not using the SpecacheCache (its update returns only the step's rows)"
        )
    q, k, v = _rows(query), _rows(key), _rows(value)
    out = torch.empty_like(q)
    cache.attend(module.layer_idx, q, k, v, out)
    return out.to(query.dtype), None


AttentionInterface.register(ATTENTION_NAME, specache_attention)
