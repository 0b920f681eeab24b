"""specache.transformers.generate: greedy generation with the agent holding the KV cache."""

import contextlib
import inspect
import threading
from typing import Optional, Sequence, Union

import torch

import specache

from .attention import ATTENTION_NAME
from .cache import SpecacheCache


def model_shape(config) -> specache.ModelShape:
    """The agent's ModelShape of a Llama-family transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return specache.ModelShape(
        n_layers=config.num_hidden_layers,
        n_q_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
    )


def kv_config(kv: Union[str, specache.KvConfig], **overrides) -> specache.KvConfig:
    """A KvConfig from a mode name ("full", "kivi", "specache", "specache-nonspec") or a KvConfig;
    keyword arguments (bits, top_k, ...) as in specache.KvConfig."""
    if isinstance(kv, specache.KvConfig):
        if overrides:
            raise ValueError("give either a KvConfig or a mode name with keyword settings, not both")
        return kv
    return specache.KvConfig(mode=kv, **overrides)


# Generations running on each model config (id -> [count, the implementation before the first]).
_SWITCHED: dict = {}
_SWITCHED_LOCK = threading.Lock()


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    # The model's layers look the attention function up by config._attn_implementation on every
    # call: switch it while generations run, so the model stays usable with its own cache after.
    # Generations on several threads share the config: the first switches it, the last restores
    # it (each thread's rows go to its own cache: active_cache() is per thread).
    config = model.config
    with _SWITCHED_LOCK:
        entry = _SWITCHED.setdefault(id(config), [0, config._attn_implementation])
        entry[0] += 1
        config._attn_implementation = name
    try:
        yield
    finally:
        with _SWITCHED_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                config._attn_implementation = entry[1]
                del _SWITCHED[id(config)]


def _prompts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Sequence[torch.Tensor]:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], not {list(input_ids.shape)}")
    if attention_mask is None:
        return [row for row in input_ids]
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have input_ids' shape")
    prompts = [row[mask.bool()] for row, mask in zip(input_ids, attention_mask)]  # padding left or right
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    return prompts


def _cache_argument(model) -> str:
    # Newer transformers name the forward's cache argument `cache` (`past_key_values` still
    # accepted for a while); older ones only `past_key_values`. forward() also takes **kwargs, so
    # a wrong name would be swallowed and the model would build a cache of its own: look it up.
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _forward(model, cache, input_ids, position_ids, **kwargs):
    kwargs[_cache_argument(model)] = cache
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **kwargs)


def _prompt_ends(logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The logits of each packed prompt's last position ([batch, vocab]) from the prefill's
    [positions, vocab]: the model kept only those (logits_to_keep), or, a model that ignores
    logits_to_keep, returned every position of the packed prompts."""
    if logits.shape[0] == last.numel():
        return logits
    if logits.shape[0] == int(last[-1]) + 1:
        return logits[last]
    raise RuntimeError(
        f"the model's prefill returned logits for {logits.shape[0]} positions: neither the "
        f"{last.numel()} asked for (logits_to_keep) nor all {int(last[-1]) + 1}"
    )


# model.generate's options this greedy loop does not have: refused by name, not taken as KV settings.
_HF_ONLY = {
    "do_sample", "temperature", "top_p", "min_p", "typical_p", "num_beams", "num_beam_groups",
    "num_return_sequences", "penalty_alpha", "repetition_penalty", "no_repeat_ngram_size",
    "min_new_tokens", "min_length", "max_length", "past_key_values", "cache", "use_cache", "streamer",
    "logits_processor", "stopping_criteria", "generation_config", "assistant_model", "output_scores",
    "return_dict_in_generate",
}


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    kv: Union[str, specache.KvConfig] = "specache",
    max_new_tokens: int = 32,
    attention_mask: Optional[torch.Tensor] = None,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    pad_token_id: Optional[int] = None,
    source: Optional[specache.FullPrecisionSource] = None,
    agent: Optional[specache.Agent] = None,
    **kv_settings,
) -> torch.Tensor:
    """Greedy generation with the specache agent holding the KV cache.

    input_ids [batch, tokens] (with attention_mask when padded, left or right); returns
    [batch, tokens + new] like model.generate: the prompt rows as given, then the new tokens
    (after a sequence's end-of-sequence token, pad_token_id). kv: a KvConfig, or a mode name
    with kv_settings (bits=, top_k=, ...). The agent computes where the model is (CPU, or CUDA
    on the current stream); `source` (default: process memory) holds the full precision, e.g. a
    specache.DaemonSource; or pass a ready `agent` (then kv, kv_settings and source are its own, and
    giving them is an error). top_k= is the agent's selection (KvConfig), not sampling's top-k:
    this is greedy decoding, and model.generate's sampling and beam options are refused.
    eos_token_id and pad_token_id default to the model's generation config.
    """
    unsupported = sorted(_HF_ONLY.intersection(kv_settings))
    if unsupported:
        raise TypeError(
            f"specache.transformers.generate is greedy decoding with its own cache: {', '.join(unsupported)} "
            "(model.generate's) not supported"
        )
    if agent is not None and (kv_settings or source is not None):
        raise TypeError("with agent=, the agent's own KvConfig and source are used: give no kv settings or source")
    if max_new_tokens is None or max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = input_ids.device
    prompts = _prompts(input_ids, attention_mask)
    lengths = [int(p.numel()) for p in prompts]
    if agent is None:
        backend = "cuda" if device.type == "cuda" else "cpu"
        agent = specache.Agent(
            model_shape(model.config),
            kv_config(kv, **kv_settings),
            source,
            backend=backend,
            device=device.index if device.type == "cuda" and device.index is not None else None,
            capacity_tokens=max(lengths) + max_new_tokens + 2,
        )
    gen = getattr(model, "generation_config", None)
    if eos_token_id is None and gen is not None:
        eos_token_id = gen.eos_token_id
    # An int, a list, or a NumPy / PyTorch integer or array of them.
    eos = (
        torch.zeros(0, dtype=torch.long, device=device)
        if eos_token_id is None
        else torch.as_tensor(eos_token_id).reshape(-1).to(device=device, dtype=torch.long)
    )
    if pad_token_id is None:
        pad_token_id = gen.pad_token_id if gen is not None and gen.pad_token_id is not None else None
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos.numel() else 0

    cache = SpecacheCache(agent)
    try:
        ids = [cache.add_sequence() for _ in prompts]
        with _attention_implementation(model, ATTENTION_NAME), cache.active():
            # Prefill: all prompts in one forward, packed one after the other; the agent attends
            # within each (ragged batch). Only each prompt's last position needs logits.
            packed = torch.cat(prompts).unsqueeze(0)
            positions = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
            last = torch.tensor(lengths, device=device).cumsum(0) - 1
            with cache.prefill(ids, lengths):
                logits = _forward(model, cache, packed, positions, logits_to_keep=last).logits
            token = _prompt_ends(logits[0], last).argmax(-1)  # [batch]

            position = torch.tensor(lengths, device=device)
            new_tokens = [token]
            done = torch.isin(token, eos)
            speculative = None
            more = max_new_tokens > 1 and not bool(done.all())  # else no step follows to use it
            if more and agent.rows_per_sequence(specache.StepKind.PRE_DECODE) > 0:
                # The first generated token attends over the replica; its top-k is the first
                # fetch and its argmax the first speculative token (it is appended next step).
                with cache.step(specache.StepKind.PRE_DECODE, ids):
                    logits = _forward(model, cache, token[:, None], position[:, None]).logits
                speculative = logits[:, -1].argmax(-1)
            for _ in range(max_new_tokens - 1):
                if bool(done.all()):
                    break
                if speculative is not None:  # rows: the real token, then the speculative one
                    rows = torch.stack([token, speculative], 1)
                    row_positions = torch.stack([position, position + 1], 1)
                else:
                    rows, row_positions = token[:, None], position[:, None]
                with cache.step(specache.StepKind.DECODE, ids):
                    logits = _forward(model, cache, rows, row_positions).logits
                token = logits[:, 0].argmax(-1)
                if speculative is not None:
                    speculative = logits[:, 1].argmax(-1)
                token = torch.where(done, torch.full_like(token, pad_token_id), token)
                done = done | torch.isin(token, eos)
                position = position + 1
                new_tokens.append(token)
    except BaseException:
        with contextlib.suppress(Exception):  # the generation's own error goes on, not a release's
            cache.release_all()
        raise
    cache.release_all()
    return torch.cat([input_ids, torch.stack(new_tokens, 1).to(input_ids.dtype)], 1)
