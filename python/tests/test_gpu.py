"""The CUDA agent from Python on PyTorch CUDA tensors (marked `gpu`: run on the GPU machine by
python/gpu/run.sh, deselected in CI). There a missing device fails; nothing skips."""

import numpy as np
import pytest

import specache
import specache.transformers as st
from replay import WORKLOADS, inputs, run_python
from specache import StatusCode, StatusError
from test_transformers import NEW_TOKENS, PROMPTS, encode, long_prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch_cuda():
    import torch

    assert specache.has_cuda, "this build of specache has no CUDA (configure with SPECACHE_CUDA=ON)"
    assert torch.cuda.is_available(), "no usable CUDA device"
    return torch


@pytest.fixture(scope="module")
def cuda_model(hf_model, torch_cuda):
    import copy

    model, tokenizer = hf_model
    return copy.deepcopy(model).to("cuda"), tokenizer


def cuda_tensor(torch):
    return lambda a: torch.from_numpy(a).to("cuda")


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_cuda_agent_matches_cpu_agent(torch_cuda, name):
    torch = torch_cuda
    w = WORKLOADS[name]
    calls = inputs(w)
    want = run_python(specache.Agent(w.shape, w.kv), w, calls)
    agent = specache.Agent(w.shape, w.kv, backend="cuda", capacity_tokens=1024)
    assert agent.backend == "cuda" and agent.device == torch.cuda.current_device()
    got = run_python(agent, w, calls, tensor=cuda_tensor(torch), to_numpy=lambda t: t.cpu().numpy())
    assert len(got.outputs) == len(want.outputs)
    for i, (a, b) in enumerate(zip(got.outputs, want.outputs)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3, err_msg=f"call {i}")
    assert got.selections == want.selections
    for key in ("rows_selected", "rows_fetched", "rows_reused", "device_bytes", "full_precision_bytes", "steps"):
        assert got.stats[key] == want.stats[key], key
    assert got.stats["device_bytes_reserved"] >= got.stats["device_bytes"]
    assert got.lengths == want.lengths


def test_cuda_agent_on_a_side_stream(torch_cuda):
    # Created under `with torch.cuda.stream(side)`, the agent queues its work on `side`; reading
    # the outputs (.cpu(), queued on the same stream) sees them complete, and they equal the
    # default-stream agent's.
    torch = torch_cuda
    w = WORKLOADS["specache-1bit"]
    calls = inputs(w)
    to_host = lambda t: t.cpu().numpy()  # noqa: E731
    want = run_python(specache.Agent(w.shape, w.kv, backend="cuda", capacity_tokens=1024), w, calls,
                      tensor=cuda_tensor(torch), to_numpy=to_host)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        agent = specache.Agent(w.shape, w.kv, backend="cuda", capacity_tokens=1024)
        got = run_python(agent, w, calls, tensor=cuda_tensor(torch), to_numpy=to_host)
    side.synchronize()
    assert got.to_bytes() == want.to_bytes()


def test_cuda_agent_refuses_host_tensors_and_cpu_agent_refuses_cuda_tensors(torch_cuda):
    torch = torch_cuda
    shape = specache.ModelShape(1, 4, 2, 64)
    gpu = specache.Agent(shape, specache.KvConfig("full"), backend="cuda", capacity_tokens=256)
    cpu = specache.Agent(shape, specache.KvConfig("full"))
    for agent in (gpu, cpu):
        agent.add_sequence(1)
    q, k = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    with pytest.raises(StatusError) as info:
        gpu.prefill_layer(0, [1], [0, 8], q, k, k, torch.zeros_like(q))
    assert info.value.code == StatusCode.INVALID_ARGUMENT and "cpu" in info.value.message
    qc, kc = q.cuda(), k.cuda()
    with pytest.raises(StatusError) as info:
        cpu.prefill_layer(0, [1], [0, 8], qc, kc, kc, torch.zeros_like(qc))
    assert info.value.code == StatusCode.INVALID_ARGUMENT and "cuda" in info.value.message
    with pytest.raises(StatusError) as info:
        gpu.prefill_layer(0, [1], [0, 8], qc.half(), kc, kc, torch.zeros_like(qc))
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(StatusError) as info:
        gpu.prefill_layer(0, [1], [0, 8], qc.transpose(0, 1).contiguous().transpose(0, 1), kc, kc,
                          torch.zeros_like(qc))
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    gpu.prefill_layer(0, [1], [0, 8], qc, kc, kc, torch.zeros_like(qc))
    gpu.release_sequence(1)
    with pytest.raises(StatusError) as info:
        gpu.begin_step(specache.StepKind.DECODE, [1])
    assert info.value.code == StatusCode.NOT_FOUND


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cuda_full_gives_the_models_own_greedy_tokens(cuda_model, prompt):
    model, tokenizer = cuda_model
    ids = encode(tokenizer, prompt).cuda()
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    got = st.generate(model, ids, kv="full", max_new_tokens=NEW_TOKENS)
    assert got.tolist() == expected.tolist()


def test_cuda_specache_with_k_at_least_the_context_gives_full(cuda_model):
    model, tokenizer = cuda_model
    ids = encode(tokenizer, long_prompt(tokenizer, 200)).cuda()
    full = st.generate(model, ids, kv="full", max_new_tokens=NEW_TOKENS)
    spec = st.generate(model, ids, kv="specache", bits=1, top_k=ids.shape[1] + NEW_TOKENS + 2,
                       max_new_tokens=NEW_TOKENS)
    assert spec.tolist() == full.tolist()


def test_cuda_one_bit_k64_gives_the_cpu_agents_tokens(hf_model, cuda_model):
    # specache-run is not built on the GPU machine; the CPU path it is compared with in CI is.
    cpu_model, tokenizer = hf_model
    model, _ = cuda_model
    ids = encode(tokenizer, long_prompt(tokenizer, 300))
    want = st.generate(cpu_model, ids, kv="specache", bits=1, top_k=64, max_new_tokens=NEW_TOKENS)
    got = st.generate(model, ids.cuda(), kv="specache", bits=1, top_k=64, max_new_tokens=NEW_TOKENS)
    assert got.cpu().tolist() == want.tolist()


def test_cuda_batch_gives_what_each_prompt_gives_alone(cuda_model):
    model, tokenizer = cuda_model
    prompts = [long_prompt(tokenizer, 120), PROMPTS[0], long_prompt(tokenizer, 90)]
    alone = [st.generate(model, encode(tokenizer, p).cuda(), kv="specache", top_k=16, max_new_tokens=8)[0].tolist()
             for p in prompts]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    together = st.generate(model, batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda(), kv="specache",
                           top_k=16, max_new_tokens=8)
    width = batch.input_ids.shape[1]
    for i, one in enumerate(alone):
        n = len(one) - len(encode(tokenizer, prompts[i])[0])
        assert together[i, width:width + n].tolist() == one[-n:]
