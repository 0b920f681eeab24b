"""specache.Agent from Python gives the C++ agent's outputs, selections and counts, byte for byte,
on NumPy arrays and on PyTorch CPU tensors, and uses the caller's memory in place."""

import gc
import threading
import time

import numpy as np
import pytest

import specache
from replay import WORKLOADS, inputs, run_cpp, run_python


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_numpy_agent_matches_cpp_agent(replay_binary, name):
    w = WORKLOADS[name]
    calls = inputs(w)
    expected = run_cpp(replay_binary, w, calls)
    got = run_python(specache.Agent(w.shape, w.kv), w, calls).to_bytes()
    assert len(got) == len(expected)
    assert got == expected


@pytest.mark.parametrize("name", ["specache-1bit", "kivi-4bit"])
def test_torch_cpu_agent_matches_cpp_agent(replay_binary, name):
    import torch

    w = WORKLOADS[name]
    calls = inputs(w)
    expected = run_cpp(replay_binary, w, calls)
    got = run_python(specache.Agent(w.shape, w.kv), w, calls, tensor=torch.from_numpy, to_numpy=lambda t: t.numpy()).to_bytes()
    assert got == expected


def test_outputs_are_written_into_the_callers_tensor():
    import torch

    shape = specache.ModelShape(1, 4, 2, 64)
    agent = specache.Agent(shape, specache.KvConfig("full"))
    agent.add_sequence(7)
    q, k, v = torch.randn(10, 4, 64), torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    out = torch.zeros(2, 5, 4, 64)  # [batch, rows, heads, d] is accepted as 10 rows
    before = out.data_ptr()
    agent.prefill_layer(0, [7], [0, 10], q, k, v, out)
    assert out.data_ptr() == before
    assert out.abs().sum() > 0
    # Row 0 attends only to itself: its output is its own (fp16-rounded) value, per query head.
    v0 = v[0].to(torch.float16).to(torch.float32)
    torch.testing.assert_close(out.reshape(10, 4, 64)[0], v0.repeat_interleave(2, dim=0), rtol=0, atol=1e-6)


def test_prefill_store_only_then_decode():
    shape = specache.ModelShape(1, 2, 1, 32)
    agent = specache.Agent(shape, specache.KvConfig("kivi", bits=2))
    agent.add_sequence(1)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((70, 1, 32), dtype=np.float32)
    agent.prefill_layer(0, [1], [0, 70], None, k, k)  # no q, no out: store only
    assert agent.sequence_length(1) == 70
    agent.begin_step(specache.StepKind.DECODE, [1])
    q = rng.standard_normal((1, 2, 32), dtype=np.float32)
    out = np.zeros_like(q)
    agent.decode_layer(0, q, k[:1], k[:1], out)
    agent.start_prefetch(0)
    agent.end_step()
    assert agent.sequence_length(1) == 71
    assert agent.stats()["steps"] == 1
    # The CUDA agent's copy-engine worker alone has host time to report.
    assert agent.stats()["fetch_host_gather_ns"] == 0


def test_a_dropped_agent_releases_its_sequences_in_the_source():
    # The source outlives the agent; the agent's sequences do not (as release_sequence, for each).
    shape = specache.ModelShape(1, 2, 1, 32)
    source = specache.InMemorySource()
    agent = specache.Agent(shape, specache.KvConfig("kivi", bits=2), source)
    k = np.random.default_rng(1).standard_normal((40, 1, 32), dtype=np.float32)
    for seq in (1, 2):
        agent.add_sequence(seq)
        agent.prefill_layer(0, [seq], [0, 40], None, k, k)
    assert source.stored_bytes > 0
    del agent
    gc.collect()
    assert source.stored_bytes == 0
    again = specache.Agent(shape, specache.KvConfig("kivi", bits=2), source)
    again.add_sequence(1)  # the id is free again


def test_config_and_shape_read_back():
    kv = specache.KvConfig("specache", key_bits=2, value_bits=1, top_k=32, reduction="max")
    assert (kv.mode, kv.key_bits, kv.value_bits, kv.top_k, kv.reduction) == ("specache", 2, 1, 32, "max")
    assert kv.describe().startswith("specache K2/V1")
    agent = specache.Agent(specache.ModelShape(2, 8, 2, 64), kv)
    assert agent.backend == "cpu" and agent.device == -1
    assert agent.config.top_k == 32 and agent.shape.n_q_heads == 8
    assert agent.rows_per_sequence(specache.StepKind.PRE_DECODE) == 1
    assert agent.rows_per_sequence(specache.StepKind.DECODE) == 2
    # Copies: assigning to them leaves the agent's own shape and configuration (which its tables
    # and the tensors' checks follow) as they were.
    shape = agent.shape
    shape.n_kv_heads = 8
    agent.config.top_k = 4
    assert agent.shape.n_kv_heads == 2 and agent.config.top_k == 32
    agent.add_sequence(1)
    k = np.zeros((3, 2, 64), dtype=np.float32)
    agent.prefill_layer(0, [1], [0, 3], None, k, k)
    with pytest.raises(specache.StatusError, match="INVALID_ARGUMENT"):  # 8 KV heads: the agent has 2
        agent.prefill_layer(1, [1], [0, 3], None, np.zeros((3, 8, 64), dtype=np.float32), k)


def test_eight_bit_host_rows_change_only_what_is_fetched_back():
    """KvConfig.round_host_rows rounds the rows the CPU agent writes to its source to 8 bits;
    host_row_format="int8" stores them as int8: the outputs move a little once such rows are
    fetched, both give the same outputs, and the configuration reads back."""
    kv = specache.KvConfig("specache", bits=1, top_k=16, round_host_rows="int8")
    assert kv.round_host_rows == "int8" and "host-round=int8" in kv.describe()
    kv = specache.KvConfig("specache", bits=1, top_k=16, host_row_format="int8")
    assert kv.host_row_format == "int8" and "host-rows=int8" in kv.describe()
    with pytest.raises(specache.StatusError, match="INVALID_ARGUMENT"):
        specache.KvConfig("specache", round_host_rows="fp8")
    with pytest.raises(specache.StatusError, match="INVALID_ARGUMENT"):
        specache.KvConfig("specache", host_row_format="int4")
    shape = specache.ModelShape(1, 2, 1, 64)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((200, 1, 64), dtype=np.float32)
    steps = [[rng.standard_normal((2, n, 64), dtype=np.float32) for n in (2, 1, 1)] for _ in range(3)]
    outs = []
    for rounding, stored in (("none", "fp16"), ("int8", "fp16"), ("none", "int8")):
        config = specache.KvConfig("specache", bits=1, top_k=16, round_host_rows=rounding, host_row_format=stored)
        agent = specache.Agent(shape, config)
        agent.add_sequence(1)
        agent.prefill_layer(0, [1], [0, 200], None, k, k)  # store only
        got = []
        for i, kind in enumerate((specache.StepKind.PRE_DECODE, specache.StepKind.DECODE, specache.StepKind.DECODE)):
            rows = agent.rows_per_sequence(kind)
            sq, sk, sv = (a[:rows] for a in steps[i])
            out = np.zeros_like(sq)
            agent.begin_step(kind, [1])
            agent.wait_prefetch(0)
            agent.decode_layer(0, sq, sk, sv, out)
            agent.start_prefetch(0)
            agent.wait_prefetch(0)
            agent.end_step()
            got.append(out)
        outs.append(np.concatenate([o.ravel() for o in got]))
    assert not np.array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=0.05)
    np.testing.assert_array_equal(outs[1], outs[2])


def test_long_calls_release_the_gil():
    # A prefill of a few thousand tokens takes a while; another Python thread must keep running
    # meanwhile (the binding drops the GIL around the agent's work).
    shape = specache.ModelShape(1, 8, 2, 64)
    agent = specache.Agent(shape, specache.KvConfig("full"))
    agent.add_sequence(1)
    n = 3072
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n, 8, 64), dtype=np.float32)
    k = rng.standard_normal((n, 2, 64), dtype=np.float32)
    out = np.zeros_like(q)
    spans = {}

    def prefill():
        spans["start"] = time.perf_counter()
        agent.prefill_layer(0, [1], [0, n], q, k, k, out)
        spans["end"] = time.perf_counter()

    ticks = []
    worker = threading.Thread(target=prefill)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    inside = [t for t in ticks if spans["start"] < t < spans["end"]]
    duration = spans["end"] - spans["start"]
    assert duration > 0.05, "the prefill was too short to tell"
    # With the GIL held for the whole call, the main thread could not tick inside it at all.
    assert len(inside) >= 5, f"{len(inside)} ticks during a {duration:.3f} s call"
