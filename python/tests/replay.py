"""Runs one agent workload both in C++ (specache-agent-replay) and through specache.Agent, on the
same random inputs, and returns each side's output bytes in the driver's format
(python/tests/agent_replay.cc)."""

import subprocess
from dataclasses import dataclass
from typing import Callable, List

import numpy as np

import specache


@dataclass
class Workload:
    shape: specache.ModelShape
    kv: specache.KvConfig
    prompt_lengths: List[int]
    steps: int
    seed: int = 1

    @property
    def ids(self):
        return [100 + i for i in range(len(self.prompt_lengths))]


def inputs(w: Workload):
    """The float32 arrays in the driver's stdin order: per call, (q, k, v) each [rows, heads, d]."""
    rng = np.random.default_rng(w.seed)
    s = w.shape
    probe = specache.Agent(s, w.kv)  # only for rows_per_sequence
    calls = []

    def rows(n):
        q = rng.standard_normal((n, s.n_q_heads, s.head_dim), dtype=np.float32)
        k = rng.standard_normal((n, s.n_kv_heads, s.head_dim), dtype=np.float32)
        v = rng.standard_normal((n, s.n_kv_heads, s.head_dim), dtype=np.float32)
        return q, k, v

    total = sum(w.prompt_lengths)
    calls.append(("prefill", [rows(total) for _ in range(s.n_layers)]))
    b = len(w.prompt_lengths)
    if probe.rows_per_sequence(specache.StepKind.PRE_DECODE):
        calls.append(("pre", [rows(b) for _ in range(s.n_layers)]))
    r = probe.rows_per_sequence(specache.StepKind.DECODE)
    for _ in range(w.steps):
        calls.append(("step", [rows(b * r) for _ in range(s.n_layers)]))
    return calls


def run_cpp(binary: str, w: Workload, calls) -> bytes:
    kv, s = w.kv, w.shape
    args = [binary, str(s.n_layers), str(s.n_q_heads), str(s.n_kv_heads), str(s.head_dim), kv.mode,
            str(kv.key_bits), str(kv.value_bits), str(kv.group_size), str(kv.residual_tokens), str(kv.top_k),
            str(kv.cached_rows), kv.reduction, str(w.steps)] + [str(n) for n in w.prompt_lengths]
    stdin = b"".join(a.tobytes() for _, layers in calls for qkv in layers for a in qkv)
    done = subprocess.run(args, input=stdin, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


STAT_KEYS = ["device_bytes", "device_bytes_reserved", "full_precision_bytes", "rows_selected", "rows_fetched",
             "rows_reused", "bytes_fetched", "steps"]


@dataclass
class Trace:
    """What a run produced, in the driver's order: every call's output (float32 array) and, after
    each decode step of a specache mode, the selections (a list of token lists, per sequence,
    layer and KV head); then the stats and the sequences' lengths."""

    items: list
    stats: dict
    lengths: list

    @property
    def outputs(self):
        return [x for x in self.items if isinstance(x, np.ndarray)]

    @property
    def selections(self):
        return [x for x in self.items if isinstance(x, list)]

    def to_bytes(self) -> bytes:
        """The driver's stdout format."""
        parts = []
        for x in self.items:
            if isinstance(x, np.ndarray):
                parts.append(x.tobytes())
            else:
                parts += [np.array([len(sel)] + list(sel), dtype=np.int32).tobytes() for sel in x]
        parts.append(np.array([self.stats[k] for k in STAT_KEYS], dtype=np.int64).tobytes())
        parts.append(np.array(self.lengths, dtype=np.int32).tobytes())
        return b"".join(parts)


def run_python(agent: specache.Agent, w: Workload, calls, tensor: Callable = lambda a: a,
               to_numpy: Callable = np.asarray) -> Trace:
    """Drives `agent` like the driver; `tensor` turns each NumPy input into what is passed (e.g. a
    torch tensor on some device), `to_numpy` reads an output back."""
    items = []
    ids = w.ids
    s = w.shape
    for sid in ids:
        agent.add_sequence(sid)
    offsets = [0]
    for n in w.prompt_lengths:
        offsets.append(offsets[-1] + n)
    for kind, layers in calls:
        if kind == "prefill":
            for layer, (q, k, v) in enumerate(layers):
                out = tensor(np.zeros_like(q))
                agent.prefill_layer(layer, ids, offsets, tensor(q), tensor(k), tensor(v), out)
                items.append(np.ascontiguousarray(to_numpy(out)))
            continue
        agent.begin_step(specache.StepKind.PRE_DECODE if kind == "pre" else specache.StepKind.DECODE, ids)
        for layer, (q, k, v) in enumerate(layers):
            out = tensor(np.zeros_like(q))
            agent.wait_prefetch(layer)
            agent.decode_layer(layer, tensor(q), tensor(k), tensor(v), out)
            agent.start_prefetch(layer)
            items.append(np.ascontiguousarray(to_numpy(out)))
        agent.end_step()
        if kind == "step" and w.kv.mode in ("specache", "specache-nonspec"):
            items.append([agent.selected_tokens(sid, layer, h) for sid in ids for layer in range(s.n_layers)
                               for h in range(s.n_kv_heads)])
    return Trace(items, agent.stats(), [agent.sequence_length(sid) for sid in ids])


# Small shapes that still exercise GQA (2 query heads per KV head), quantized groups (prompts
# longer than R + G) and the top-k (k below the context).
WORKLOADS = {
    "specache-1bit": Workload(specache.ModelShape(3, 4, 2, 64), specache.KvConfig("specache", bits=1, top_k=16),
                              [150, 97], steps=6),
    "specache-2bit-max": Workload(specache.ModelShape(2, 4, 2, 64),
                                  specache.KvConfig("specache", bits=2, top_k=8, reduction="max"), [200, 130, 71],
                                  steps=5, seed=2),
    "kivi-4bit": Workload(specache.ModelShape(2, 4, 2, 64), specache.KvConfig("kivi", bits=4), [180], steps=4, seed=3),
    "full": Workload(specache.ModelShape(2, 4, 2, 64), specache.KvConfig("full"), [90, 40], steps=4, seed=4),
    "specache-nonspec": Workload(specache.ModelShape(2, 4, 2, 64),
                                 specache.KvConfig("specache-nonspec", bits=1, top_k=16), [160], steps=4, seed=5),
}
