"""Decode tokens/s of specache.transformers.generate next to the model's own generate (its
default cache, DynamicCache), batch B at a context of C tokens, and the Python overhead of
specache's glue per decode step. One run; prints one JSON object (and writes it with --json).

    python3 python/gpu/bench_decode.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --batch 8 --context 8192 --new-tokens 64 --json out.json

Decode tokens/s = batch x (new tokens - 1) / (time of a generate of N new tokens - time of a
generate of 1 new token): the prompt pass cancels out. Both generate greedily, float32, on one
GPU, with no early stop (no end-of-sequence token).

Overhead: the decode steps run once more with each step synchronised, and the host time spent in
specache's Python code (the attention function and the cache's step bookkeeping, including the
transposes into the agent's layout, minus the time inside the agent's C++ calls) is divided by
the step's wall time.
"""

import argparse
import json
import pathlib
import sys
import time

import torch

import specache
import specache.transformers as st
from specache.transformers import attention as st_attention
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

# SmolLM2-135M's shapes, for a run without the GGUF file (weights random; the step's cost is the
# same: same shapes, same kernels).
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)


def load(model_path: str):
    path = pathlib.Path(model_path) if model_path else None
    if path is not None and path.is_file():
        from transformers.utils import logging

        logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return model, f"{path.name} (transformers GGUF loader)"
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.float32), "SmolLM2-135M shapes, random weights"


class TimedAgent(specache.Agent):
    """The agent, with the host time spent inside its calls added up."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = 0.0

    def _timed(name):
        def call(self, *args):
            t = time.perf_counter()
            try:
                return getattr(specache.Agent, name)(self, *args)
            finally:
                self.seconds += time.perf_counter() - t

        return call

    begin_step = _timed("begin_step")
    end_step = _timed("end_step")
    decode_layer = _timed("decode_layer")
    wait_prefetch = _timed("wait_prefetch")
    start_prefetch = _timed("start_prefetch")
    abort_step = _timed("abort_step")


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bits", type=int, default=1)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--json", default="")
    a = p.parse_args()

    model, weights = load(a.model)
    model = model.to("cuda").eval()
    prompt_len = a.context - a.new_tokens
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, model.config.vocab_size, (a.batch, prompt_len), generator=g).cuda()
    kv = specache.KvConfig("specache", bits=a.bits, top_k=a.top_k)
    no_eos = dict(eos_token_id=[], pad_token_id=0)

    def hf(n):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def ours(n, agent=None):
        return st.generate(model, ids, kv=kv, max_new_tokens=n, agent=agent, **no_eos)

    with torch.inference_mode():
        hf(2), ours(2)  # warm-up: kernels, allocator
        hf_1, _ = timed(lambda: hf(1))
        hf_n, _ = timed(lambda: hf(a.new_tokens))
        sc_1, _ = timed(lambda: ours(1))
        sc_n, out = timed(lambda: ours(a.new_tokens))
        assert out.shape == (a.batch, a.context)
        decode_steps = a.new_tokens - 1
        hf_tps = a.batch * decode_steps / (hf_n - hf_1)
        sc_tps = a.batch * decode_steps / (sc_n - sc_1)

        # Overhead: one more generate, each step synchronised, the glue's host time measured.
        glue = {"attention": 0.0, "agent_in_attention": 0.0, "steps": []}
        attention = st_attention.specache_attention
        agent = TimedAgent(st.model_shape(model.config), kv, backend="cuda", capacity_tokens=a.context + 2)

        def timed_attention(*args, **kwargs):
            t, inside = time.perf_counter(), agent.seconds
            try:
                return attention(*args, **kwargs)
            finally:
                glue["attention"] += time.perf_counter() - t
                glue["agent_in_attention"] += agent.seconds - inside

        step = st.SpecacheCache.step

        def timed_step(cache, kind, ids_):
            ctx = step(cache, kind, ids_)

            class Wrapped:
                def __enter__(self):
                    torch.cuda.synchronize()
                    self.t = time.perf_counter()
                    self.attention, self.agent = glue["attention"], glue["agent_in_attention"]
                    return ctx.__enter__()

                def __exit__(self, *exc):
                    r = ctx.__exit__(*exc)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - self.t
                    if kind == specache.StepKind.DECODE:
                        glue["steps"].append((wall, glue["attention"] - self.attention,
                                              glue["agent_in_attention"] - self.agent))
                    return r

            return Wrapped()

        AttentionInterface.register(st.ATTENTION_NAME, timed_attention)
        st.SpecacheCache.step = timed_step
        try:
            ours(a.new_tokens, agent=agent)
        finally:
            AttentionInterface.register(st.ATTENTION_NAME, attention)
            st.SpecacheCache.step = step
        steps = glue["steps"]
        wall = sum(s[0] for s in steps) / len(steps)
        in_attention = sum(s[1] for s in steps) / len(steps)
        in_agent = sum(s[2] for s in steps) / len(steps)
        # Python glue: the attention function's host time (layout copies, argument checks, the
        # cache's dispatch) minus the agent's calls inside it, which are the C++ agent's own work.
        python_glue = in_attention - in_agent
        result = {
            "device": torch.cuda.get_device_name(),
            "weights": weights,
            "batch": a.batch,
            "context": a.context,
            "prompt_tokens": prompt_len,
            "new_tokens": a.new_tokens,
            "kv": kv.describe(),
            "torch": torch.__version__,
            "model_generate_decode_tokens_per_s": round(hf_tps, 1),
            "specache_generate_decode_tokens_per_s": round(sc_tps, 1),
            "specache_over_model_generate": round(sc_tps / hf_tps, 3),
            "model_generate_step_ms": round(1000 * (hf_n - hf_1) / decode_steps, 3),
            "specache_step_ms": round(1000 * (sc_n - sc_1) / decode_steps, 3),
            "synchronised_step_ms": round(1000 * wall, 3),
            "attention_function_host_ms_per_step": round(1000 * in_attention, 3),
            "agent_calls_in_attention_host_ms_per_step": round(1000 * in_agent, 3),
            "python_glue_ms_per_step": round(1000 * python_glue, 3),
            "python_glue_fraction_of_step": round(python_glue / wall, 4),
            "agent_stats": agent.stats(),
        }
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        pathlib.Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
