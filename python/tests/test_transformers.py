"""specache.transformers on SmolLM2-135M loaded by transformers from the project's GGUF file
(CPU, float32): `full` gives the model's own greedy tokens, specache with k >= context gives
`full`'s, 1-bit k = 64 gives specache-run's, batches give what each prompt gives alone."""

import json
import pathlib
import subprocess

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
