"""SpecacheCache: the transformers Cache whose keys and values live in the specache agent.

transformers hands every layer's new key/value rows to Cache.update and attends over what it
returns. This cache stores nothing in tensors: update() returns the rows as they are and the
specache attention (attention.py) gives them to the agent, which appends them to its low-bit
replica and to the full-precision source and attends over those. The cache only knows which
phase the driver is in (a prefill of some sequences, or a step) and tells the agent.
"""

import contextlib
import contextvars
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache

import specache

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("specache_cache", default=None)


def active_cache() -> Optional["SpecacheCache"]:
    """The cache the specache attention works for (set by SpecacheCache.active())."""
    return _ACTIVE.get()


class SpecacheCache(Cache):
    """KV cache held by a specache.Agent: one agent sequence per batch row of a generation."""

    is_compileable = False

    def __init__(self, agent: specache.Agent):
        try:
            super().__init__(layers=[])  # transformers >= 4.56: layers are ours to manage (none)
        except TypeError:
            super().__init__()
        self.agent = agent
        self._phase = None  # ("prefill", ids, offsets) or ("step", ids)
        self._next_id = 0
        self._lengths = {}

    # ---- what transformers calls
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **kwargs):
        if self._phase is None:
            raise RuntimeError(
                "SpecacheCache used outside a prefill or a step of its driver "
                "(specache.transformers.generate, not model.generate)"
            )
        return key_states, value_states

    # transformers' edits of a cache's rows (beam search, assisted and contrastive decoding): the
    # rows are the agent's, which has no such edits. Inherited, they would do nothing, silently.
    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"SpecacheCache.{what}: the rows are held by the specache agent, which cannot {what.replace('_', ' ')}; "
            "specache.transformers.generate is greedy decoding"
        )

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop")

    def reorder_cache(self, beam_idx):
        self._unsupported("reorder_cache")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch_repeat_interleave")

    def reset(self):
        self._unsupported("reset")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self._lengths.values(), default=0)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def __len__(self) -> int:
        return self.agent.shape.n_layers

    # ---- the driver's side (generate.py, or an engine's own loop)
    def add_sequence(self) -> int:
        """A new agent sequence for a batch row: the next id the agent does not hold already (the
        agent may serve other caches, or its owner's own sequences)."""
        while True:
            sid = self._next_id
            self._next_id += 1
            try:
                self.agent.add_sequence(sid)
            except specache.StatusError as e:
                if e.code == specache.StatusCode.ALREADY_EXISTS:
                    continue
                raise
            self._lengths[sid] = 0
            return sid

    def release_sequence(self, sid: int) -> None:
        self.agent.release_sequence(sid)
        del self._lengths[sid]

    def release_all(self) -> None:
        """Releases every sequence of this cache; each is tried, then the first error is raised."""
        first = None
        for sid in list(self._lengths):
            try:
                self.release_sequence(sid)
            except Exception as e:  # noqa: BLE001 - the others are still released
                first = first or e
        if first is not None:
            raise first

    @contextlib.contextmanager
    def active(self):
        """While it holds, the specache attention function sends its rows to this cache's agent."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def prefill(self, ids: Sequence[int], lengths: Sequence[int]):
        """One forward over the prompts of `ids`, packed one after the other ([1, sum(lengths)])."""
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + int(n))
        self._phase = ("prefill", list(ids), offsets)
        try:
            yield
        finally:
            self._phase = None
        for sid, n in zip(ids, lengths):
            self._lengths[sid] += int(n)

    @contextlib.contextmanager
    def step(self, kind: "specache.StepKind", ids: Sequence[int]):
        """One forward of a step: [len(ids), agent.rows_per_sequence(kind)] rows."""
        ids = list(ids)
        self.agent.begin_step(kind, ids)
        self._phase = ("step", ids)
        try:
            yield
        except BaseException:
            self._phase = None
            self.agent.abort_step()
            raise
        self._phase = None
        try:
            self.agent.end_step()
        except BaseException:
            self.agent.abort_step()  # the agent leaves the step; its sequences can be released
            raise
        if kind == specache.StepKind.DECODE:
            for sid in ids:
                self._lengths[sid] += 1

    def longest_context(self, rows: int) -> int:
        """The most tokens a sequence of this phase attends over, with the phase's `rows` rows
        (a prefill's packed prompts: their longest)."""
        if self._phase is None:
            return 0
        if self._phase[0] == "prefill":
            _, ids, offsets = self._phase
            return max((self._lengths[s] + offsets[i + 1] - offsets[i] for i, s in enumerate(ids)), default=0)
        return max((self._lengths[s] for s in self._phase[1]), default=0) + rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """The layer's attention by the agent: rows [batch, rows, heads, head_dim] float32."""
        if self._phase is None:
            raise RuntimeError("specache attention outside a prefill or a step")
        if self._phase[0] == "prefill":
            _, ids, offsets = self._phase
            self.agent.prefill_layer(layer, ids, offsets, q, k, v, out)
        else:
            self.agent.wait_prefetch(layer)
            self.agent.decode_layer(layer, q, k, v, out)
            self.agent.start_prefetch(layer)
