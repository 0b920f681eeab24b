"""specache.transformers on SmolLM2-135M loaded by transformers from the project's GGUF file
(CPU, float32): `full` gives the model's own greedy tokens, specache with k >= context gives
`full`'s, 1-bit k = 64 gives specache-run's, batches give what each prompt gives alone; and what
generate refuses (model.generate's options, a sliding window), reused agents, threads."""

import json
import pathlib
import subprocess
import time

import pytest
import torch

import specache
import specache.transformers as st

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
NEW_TOKENS = 12
TEXT = (pathlib.Path(__file__).resolve().parents[2] / "tools" / "data" / "gpl-3.0.txt").read_text()


def long_prompt(tokenizer, tokens: int) -> str:
    """The start of the GPL text, cut at a word so that it is about `tokens` tokens long."""
    words = TEXT.split(" ")
    text = ""
    for w in words:
        candidate = text + w + " "
        if len(tokenizer(candidate).input_ids) > tokens:
            break
        text = candidate
    return text.rstrip()


def encode(tokenizer, text):
    return torch.tensor([tokenizer(text).input_ids])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_full_gives_the_models_own_greedy_tokens(hf_model, prompt):
    model, tokenizer = hf_model
    ids = encode(tokenizer, prompt)
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    got = st.generate(model, ids, kv="full", max_new_tokens=NEW_TOKENS)
    assert got.tolist() == expected.tolist(), tokenizer.decode(got[0]) + " | " + tokenizer.decode(expected[0])
    # The model is left as it was: its own attention and cache work afterwards.
    assert model.config._attn_implementation != st.ATTENTION_NAME


def test_specache_with_k_at_least_the_context_gives_full(hf_model):
    model, tokenizer = hf_model
    ids = encode(tokenizer, long_prompt(tokenizer, 200))
    full = st.generate(model, ids, kv="full", max_new_tokens=NEW_TOKENS)
    k = ids.shape[1] + NEW_TOKENS + 2  # every token of the context is fetched in full precision
    spec = st.generate(model, ids, kv="specache", bits=1, top_k=k, max_new_tokens=NEW_TOKENS)
    assert spec.tolist() == full.tolist()


def specache_run_output(binary, model_path, prompt, *kv_args):
    done = subprocess.run(
        [binary, "generate", "--model", str(model_path), "--prompt", prompt, "--raw-prompt", "--json",
         "--max-tokens", str(NEW_TOKENS), "--backend", "cpu", "--kv-memory", "process", *kv_args],
        capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def specache_run_tokens(binary, model_path, prompt):
    done = subprocess.run([binary, "logits", "--model", str(model_path), "--prompt", prompt, "--raw-prompt"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["tokens"]


# specache-run's own default selection is not the library's: the paper's rule is asked for by name.
@pytest.mark.parametrize("kv,kv_args", [("full", ["--kv", "full"]),
                                        ("specache", ["--kv", "specache", "--bits", "1", "--topk", "64",
                                                      "--select", "spec", "--no-attend-resident"])])
def test_one_bit_k64_gives_specache_runs_tokens(hf_model, specache_run, model_path, kv, kv_args):
    model, tokenizer = hf_model
    prompt = long_prompt(tokenizer, 300)  # longer than R + k, so the replica and the top-k matter
    ids = encode(tokenizer, prompt)
    # Both tokenize the prompt alike (specache-run has its own BPE; transformers reads the GGUF's).
    assert specache_run_tokens(specache_run, model_path, prompt) == ids[0].tolist()
    reference = specache_run_output(specache_run, model_path, prompt, *kv_args)
    settings = {"bits": 1, "top_k": 64} if kv == "specache" else {}
    got = st.generate(model, ids, kv=kv, max_new_tokens=NEW_TOKENS, **settings)
    text = tokenizer.decode(got[0, ids.shape[1]:], skip_special_tokens=True)
    assert text == reference["output"]


def test_batch_gives_what_each_prompt_gives_alone(hf_model):
    model, tokenizer = hf_model
    prompts = [long_prompt(tokenizer, 120), PROMPTS[0], long_prompt(tokenizer, 90)]
    alone = [st.generate(model, encode(tokenizer, p), kv="specache", bits=1, top_k=16, max_new_tokens=8)
             for p in prompts]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    together = st.generate(model, batch.input_ids, attention_mask=batch.attention_mask, kv="specache", bits=1,
                           top_k=16, max_new_tokens=8)
    width = batch.input_ids.shape[1]
    for i, one in enumerate(alone):
        n = one.shape[1] - (encode(tokenizer, prompts[i]).shape[1])
        assert together[i, width:width + n].tolist() == one[0, -n:].tolist()


def test_a_model_that_ignores_logits_to_keep_gets_each_prompts_last_position(hf_model):
    # Prefill asks for each packed prompt's last position only (logits_to_keep); a model that
    # ignores the argument returns every position, and each prompt's own last one is still taken.
    import functools

    model, tokenizer = hf_model
    prompts = [PROMPTS[1], long_prompt(tokenizer, 40)]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    want = st.generate(model, batch.input_ids, attention_mask=batch.attention_mask, kv="full", max_new_tokens=4)
    original = model.forward

    @functools.wraps(original)
    def ignoring_logits_to_keep(*args, logits_to_keep=0, **kwargs):
        return original(*args, **kwargs)

    model.forward = ignoring_logits_to_keep
    try:
        got = st.generate(model, batch.input_ids, attention_mask=batch.attention_mask, kv="full", max_new_tokens=4)
    finally:
        del model.forward
    assert got.tolist() == want.tolist()


def generate_counting_forwards(model, *args, **kwargs):
    """st.generate's output and how many forwards of the model it ran."""
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    try:
        return st.generate(model, *args, **kwargs), len(forwards)
    finally:
        hook.remove()


def test_one_new_token_is_the_prefills_with_no_step_after_it(hf_model):
    # The prompts' forward alone gives the first token: with max_new_tokens=1 no pre-decode step
    # runs (its selection and speculative token would serve no later step).
    model, tokenizer = hf_model
    ids = encode(tokenizer, PROMPTS[0])
    got, forwards = generate_counting_forwards(model, ids, kv="specache", bits=1, top_k=16, max_new_tokens=1)
    assert forwards == 1
    assert got.tolist() == st.generate(model, ids, kv="full", max_new_tokens=1).tolist()
    # Nor when every sequence ends at its first token (it is the end-of-sequence token).
    ended, forwards = generate_counting_forwards(
        model, ids, kv="specache", bits=1, top_k=16, max_new_tokens=4, eos_token_id=int(got[0, -1])
    )
    assert forwards == 1
    assert ended.tolist() == got.tolist()


def test_generate_on_daemon_pages(hf_model):
    model, tokenizer = hf_model
    ids = encode(tokenizer, long_prompt(tokenizer, 150))
    in_process = st.generate(model, ids, kv="specache", top_k=16, max_new_tokens=6)
    daemon = specache.EmbeddedDaemon(pool_bytes=64 << 20)
    try:
        client = specache.Client.connect(daemon.socket)
        session = client.open_session("default", 32 << 20)
        source = specache.DaemonSource(session, capacity_tokens=1024)
        on_daemon = st.generate(model, ids, kv="specache", top_k=16, max_new_tokens=6, source=source)
        assert on_daemon.tolist() == in_process.tolist()
        assert client.stats()["sequences"] == 0  # generate released its sequences
        del source, session
    finally:
        daemon.stop()


def test_cache_and_attention_are_registered():
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache

    assert AttentionInterface._global_mapping[st.ATTENTION_NAME] is st.specache_attention
    assert issubclass(st.SpecacheCache, Cache)


def test_attention_outside_generate_is_refused(hf_model):
    model, tokenizer = hf_model
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = st.ATTENTION_NAME
    try:
        with pytest.raises(RuntimeError, match="specache"):
            model(encode(tokenizer, "Hello"))
    finally:
        config._attn_implementation = previous


def test_bad_generate_arguments(hf_model):
    model, tokenizer = hf_model
    ids = encode(tokenizer, "Hello")
    with pytest.raises(specache.StatusError) as info:
        st.generate(model, ids, kv="specache", bits=3, max_new_tokens=2)
    assert info.value.code == specache.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        st.generate(model, ids[0], kv="full", max_new_tokens=2)
    with pytest.raises(ValueError):
        st.generate(model, ids, kv="full", max_new_tokens=0)
    with pytest.raises(TypeError, match="do_sample"):
        st.generate(model, ids, kv="full", max_new_tokens=2, do_sample=True, temperature=0.7)
    agent = specache.Agent(st.model_shape(model.config), specache.KvConfig("full"))
    with pytest.raises(TypeError, match="agent="):
        st.generate(model, ids, agent=agent, max_new_tokens=2, bits=4)


def test_an_agent_that_holds_sequences_serves_generate_beside_them(hf_model):
    # The cache takes ids the agent does not hold, and gives back only its own.
    model, tokenizer = hf_model
    ids = encode(tokenizer, PROMPTS[0])
    agent = specache.Agent(st.model_shape(model.config), specache.KvConfig("full"))
    agent.add_sequence(0)
    agent.add_sequence(1)
    expected = st.generate(model, ids, kv="full", max_new_tokens=4)
    for _ in range(2):
        assert st.generate(model, ids, agent=agent, max_new_tokens=4).tolist() == expected.tolist()
    agent.release_sequence(0)
    agent.release_sequence(1)
    agent.add_sequence(2)  # generate's sequences are gone


def test_output_is_an_ordinary_tensor_and_eos_may_be_numpy(hf_model):
    import numpy as np

    model, tokenizer = hf_model
    ids = encode(tokenizer, PROMPTS[1])
    out = st.generate(model, ids, kv="full", max_new_tokens=3, eos_token_id=np.int64(2))
    out[:, -1] = 0  # an inference-mode tensor would refuse this
    assert out.shape == (1, ids.shape[1] + 3)
    st.generate(model, ids, kv="full", max_new_tokens=2, eos_token_id=torch.tensor([2, 0]))


def test_a_step_whose_end_fails_leaves_the_agent_out_of_it(hf_model):
    # A step in which no layer ran: EndStep refuses it; the cache aborts the step, so its
    # sequences can be released and the agent begins new steps.
    model, _ = hf_model
    agent = specache.Agent(st.model_shape(model.config), specache.KvConfig("full"))
    cache = st.SpecacheCache(agent)
    sid = cache.add_sequence()
    k = torch.randn(4, model.config.num_key_value_heads, st.model_shape(model.config).head_dim)
    with cache.prefill([sid], [4]):
        for layer in range(model.config.num_hidden_layers):
            agent.prefill_layer(layer, [sid], [0, 4], None, k, k)
    with pytest.raises(specache.StatusError) as info:
        with cache.step(specache.StepKind.DECODE, [sid]):
            pass
    assert info.value.code == specache.StatusCode.FAILED_PRECONDITION
    agent.begin_step(specache.StepKind.DECODE, [sid])  # not inside the failed step any more
    agent.abort_step()
    cache.release_all()
    agent.add_sequence(sid)


def test_a_sliding_window_shorter_than_the_context_is_refused():
    # The agent attends over the whole context: a layer whose window is shorter would be wrong.
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=8,
    )
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, 100, (1, 20))
    with pytest.raises(NotImplementedError, match="sliding window"):
        st.generate(model, ids, kv="full", max_new_tokens=2)
    assert model.config._attn_implementation != st.ATTENTION_NAME
    model.config.sliding_window = 64  # longer than the context: the same as none
    wide = st.generate(model, ids, kv="full", max_new_tokens=4)
    assert wide.tolist() == model.generate(ids, max_new_tokens=4, do_sample=False).tolist()


def test_generations_on_two_threads_leave_the_model_as_it_was(hf_model):
    import threading

    model, tokenizer = hf_model
    prompts = [encode(tokenizer, long_prompt(tokenizer, 300)), encode(tokenizer, PROMPTS[2])]
    alone = [st.generate(model, p, kv="full", max_new_tokens=6).tolist() for p in prompts]
    before = model.config._attn_implementation
    got, errors = [None, None], []

    def run(i):
        try:
            got[i] = st.generate(model, prompts[i], kv="full", max_new_tokens=6).tolist()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # Each first, the other 50 ms later: one ends while the other still runs.
    for order in ([1, 0], [0, 1]):
        threads = [threading.Thread(target=run, args=(i,)) for i in order]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert not errors, errors
        assert got == alone
        assert model.config._attn_implementation == before


def test_the_caches_row_edits_are_refused_not_silent(hf_model):
    # Beam search, assisted and contrastive decoding edit a cache's rows; the agent's cannot be.
    model, tokenizer = hf_model
    cache = st.SpecacheCache(specache.Agent(st.model_shape(model.config), specache.KvConfig("full")))
    for call in (lambda: cache.crop(1), lambda: cache.reorder_cache(torch.tensor([0])),
                 lambda: cache.batch_select_indices(torch.tensor([0])), lambda: cache.batch_repeat_interleave(2),
                 cache.reset):
        with pytest.raises(NotImplementedError, match="SpecacheCache"):
            call()
    from specache.transformers.generate import _cache_argument

    with pytest.raises(RuntimeError, match="specache.transformers.generate"):
        model.generate(encode(tokenizer, "Hello"), max_new_tokens=2, do_sample=False, **{_cache_argument(model): cache})
