"""Bad input gives a specache.StatusError with the Status code, never a crash: wrong dtype,
device, shape or stride, released sequences, calls out of order, bad configs."""

import numpy as np
import pytest

import specache
from specache import StatusCode, StatusError

SHAPE = specache.ModelShape(2, 4, 2, 64)


def prefilled_agent(mode="specache", n=80):
    agent = specache.Agent(SHAPE, specache.KvConfig(mode, bits=1, top_k=8))
    agent.add_sequence(1)
    rng = np.random.default_rng(0)
    for layer in range(SHAPE.n_layers):
        q = rng.standard_normal((n, 4, 64), dtype=np.float32)
        k = rng.standard_normal((n, 2, 64), dtype=np.float32)
        agent.prefill_layer(layer, [1], [0, n], q, k, k, np.zeros_like(q))
    return agent


def step_rows(rows=2):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((rows, 4, 64), dtype=np.float32)
    k = rng.standard_normal((rows, 2, 64), dtype=np.float32)
    return q, k, k.copy(), np.zeros_like(q)


def raises(code):
    return pytest.raises(StatusError, match=code.name)


def test_error_carries_code_and_message():
    with pytest.raises(StatusError) as info:
        specache.KvConfig("fastest")
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    assert "fastest" in info.value.message
    assert str(info.value).startswith("INVALID_ARGUMENT: ")


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_wrong_dtype(dtype):
    agent = prefilled_agent()
    agent.begin_step(specache.StepKind.DECODE, [1])
    q, k, v, out = step_rows()
    with raises(StatusCode.INVALID_ARGUMENT) as info:
        agent.decode_layer(0, q.astype(dtype), k, v, out)
    assert "q: dtype must be float32" in info.value.message


def test_wrong_shape():
    agent = prefilled_agent()
    agent.begin_step(specache.StepKind.DECODE, [1])
    q, k, v, out = step_rows()
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.decode_layer(0, q[:1], k, v, out)  # one row where the step has two
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.decode_layer(0, q, k, v, np.zeros((2, 4, 32), np.float32))  # wrong head_dim
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.decode_layer(0, q, k, v, np.zeros(8 * 64, np.float32))  # flat: heads and d not shaped


def test_wrong_stride_is_refused_not_copied():
    agent = prefilled_agent()
    agent.begin_step(specache.StepKind.DECODE, [1])
    q, k, v, out = step_rows()
    wide = np.zeros((2, 4, 128), np.float32)
    with raises(StatusCode.INVALID_ARGUMENT) as info:
        agent.decode_layer(0, q, k, v, wide[:, :, ::2])
    assert "C-contiguous" in info.value.message
    transposed = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.decode_layer(0, transposed, k, v, out)


def test_not_a_tensor_is_a_type_error():
    agent = prefilled_agent()
    agent.begin_step(specache.StepKind.DECODE, [1])
    q, k, v, out = step_rows()
    with pytest.raises(TypeError):
        agent.decode_layer(0, "not a tensor", k, v, out)


def test_released_sequence():
    agent = prefilled_agent()
    agent.release_sequence(1)
    with raises(StatusCode.NOT_FOUND):
        agent.begin_step(specache.StepKind.DECODE, [1])
    with raises(StatusCode.NOT_FOUND):
        agent.sequence_length(1)
    with raises(StatusCode.NOT_FOUND):
        agent.release_sequence(1)


def test_calls_out_of_order():
    agent = prefilled_agent()
    q, k, v, out = step_rows()
    with raises(StatusCode.FAILED_PRECONDITION):
        agent.decode_layer(0, q, k, v, out)  # no step begun
    with raises(StatusCode.FAILED_PRECONDITION):
        agent.end_step()
    agent.begin_step(specache.StepKind.DECODE, [1])
    with raises(StatusCode.FAILED_PRECONDITION):
        agent.begin_step(specache.StepKind.DECODE, [1])  # a step is already open
    agent.decode_layer(0, q, k, v, out)
    with raises(StatusCode.FAILED_PRECONDITION):
        agent.end_step()  # layer 1 not decoded, prefetches not started
    agent.abort_step()
    with raises(StatusCode.FAILED_PRECONDITION):  # the prompt is already in: no second prefill
        agent.prefill_layer(0, [1], [0, 2], q, k, v, out)
    with raises(StatusCode.ALREADY_EXISTS):
        agent.add_sequence(1)
    fresh = specache.Agent(SHAPE, specache.KvConfig("specache"))
    fresh.add_sequence(3)
    with raises(StatusCode.FAILED_PRECONDITION):
        fresh.begin_step(specache.StepKind.DECODE, [3])  # not prefilled


def test_layer_out_of_range():
    agent = prefilled_agent()
    agent.begin_step(specache.StepKind.DECODE, [1])
    q, k, v, out = step_rows()
    with raises(StatusCode.OUT_OF_RANGE):
        agent.decode_layer(SHAPE.n_layers, q, k, v, out)
    with raises(StatusCode.OUT_OF_RANGE):
        agent.selected_tokens(1, 0, 5)


def test_bad_prefill_arguments():
    agent = specache.Agent(SHAPE, specache.KvConfig("full"))
    agent.add_sequence(1)
    q = np.zeros((4, 4, 64), np.float32)
    k = np.zeros((4, 2, 64), np.float32)
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, [1], [0, 5], q, k, k, np.zeros_like(q))  # offsets past the rows
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, [1], [1, 4], q, k, k, np.zeros_like(q))  # must start at 0
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, [1], [0, 4], q, k, k, None)  # q without out
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, [-1], [0, 4], q, k, k, np.zeros_like(q))
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, "ab", [0, 4], q, k, k, np.zeros_like(q))
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, [True], [0, 4], q, k, k, np.zeros_like(q))  # a bool is not an id
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.prefill_layer(0, np.array([2**63], np.uint64), [0, 4], q, k, k, np.zeros_like(q))
    with raises(StatusCode.INVALID_ARGUMENT):
        agent.add_sequence(2**63 + 1)  # no list of int64 could name it afterwards


def test_integer_lists_take_numpy_scalars_and_unsigned_arrays():
    """numpy's integer scalars in a list, and uint32 ids above 2**31 in an array, are the ints they
    hold (a list of np.int64 was refused, and uint32 2**31 + 5 read as a negative id)."""
    agent = specache.Agent(SHAPE, specache.KvConfig("full"))
    big = 2**31 + 5
    agent.add_sequence(big)
    q = np.zeros((4, 4, 64), np.float32)
    k = np.zeros((4, 2, 64), np.float32)
    agent.prefill_layer(0, np.array([big], np.uint32), [np.int64(0), np.int64(4)], q, k, k, np.zeros_like(q))
    agent.prefill_layer(1, [np.uint32(big)], np.array([0, 4], np.uint64), q, k, k, np.zeros_like(q))
    assert agent.sequence_length(big) == 4


def test_bad_shape_and_config():
    with raises(StatusCode.INVALID_ARGUMENT):
        specache.ModelShape(2, 6, 4, 64)  # 6 query heads over 4 KV heads
    with raises(StatusCode.INVALID_ARGUMENT):
        specache.Agent(SHAPE, specache.KvConfig("specache", bits=3))
    with raises(StatusCode.INVALID_ARGUMENT):
        specache.Agent(SHAPE, specache.KvConfig("specache", top_k=0))
    with raises(StatusCode.INVALID_ARGUMENT):
        specache.KvConfig(reduction="median")
    with raises(StatusCode.INVALID_ARGUMENT):
        specache.Agent(SHAPE, specache.KvConfig(), backend="tpu")


def test_cuda_backend_without_a_device_is_unavailable():
    # CI has no GPU: a CUDA build says UNAVAILABLE (no usable device), a CPU-only build too (no
    # CUDA). Where a device is usable the same call must give a CUDA agent.
    import torch

    if torch.cuda.is_available() and specache.has_cuda:
        assert specache.Agent(SHAPE, specache.KvConfig(), backend="cuda").backend == "cuda"
        return
    with raises(StatusCode.UNAVAILABLE):
        specache.Agent(SHAPE, specache.KvConfig(), backend="cuda", device=0, stream=0)
