#!/usr/bin/env python3
"""The fp16 baseline next to `specache-bench step`/`attend`: the same 32-layer Llama-3-8B decode
step with the whole KV cache in fp16 on the GPU, attention by PyTorch's
scaled_dot_product_attention (GQA), projections and MLP by torch matmuls (cuBLAS); and the
prefill of B x T tokens (causal SDPA + GEMMs). One JSON object per line on stdout, a table on
stderr. Needs PyTorch with CUDA.

  fp16_baseline.py --batches 8,32 --contexts 8192,32768 [--prefill 8x8192] [--steps 10]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 4096, 32, 8, 128, 14336


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


class Weights:
    def __init__(self, layers):
        g = torch.Generator(device="cuda").manual_seed(1)
        def w(*shape):
            return (torch.rand(*shape, device="cuda", generator=g, dtype=torch.float16) - 0.5) * 0.04
        self.qkv = [w(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM) for _ in range(layers)]
        self.o = [w(HIDDEN, HIDDEN) for _ in range(layers)]
        self.gu = [w(HIDDEN, 2 * FFN) for _ in range(layers)]
        self.d = [w(FFN, HIDDEN) for _ in range(layers)]


def mlp(x, wts, l):
    gu = x @ wts.gu[l]
    return (F.silu(gu[:, :FFN]) * gu[:, FFN:]) @ wts.d[l]


def decode(batch, context, wts, steps):
    kv_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * 2 * LAYERS
    if kv_bytes > torch.cuda.mem_get_info()[0] - (4 << 30):
        return {"suite": "fp16_decode", "batch": batch, "context": context,
                "skipped": f"its fp16 KV cache ({kv_bytes / 2**30:.0f} GiB) does not fit beside the weights"}
    kv = [torch.randn(2, batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.float16)
          for _ in range(LAYERS)]
    x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.float16)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.float16)

    def attention_only():
        for l in range(LAYERS):
            F.scaled_dot_product_attention(q, kv[l][0], kv[l][1], enable_gqa=True)

    def gemms_only():
        for l in range(LAYERS):
            x @ wts.qkv[l]
            mlp(x @ wts.o[l], wts, l)

    def step():
        h = x
        for l in range(LAYERS):
            qkv = h @ wts.qkv[l]
            ql = qkv[:, :HIDDEN].reshape(batch, Q_HEADS, 1, HEAD_DIM)
            a = F.scaled_dot_product_attention(ql, kv[l][0], kv[l][1], enable_gqa=True)
            h = mlp(a.reshape(batch, HIDDEN) @ wts.o[l], wts, l)

    attn = median_ms(attention_only, steps)
    gemm = median_ms(gemms_only, steps)
    whole = median_ms(step, steps)
    del kv
    torch.cuda.empty_cache()
    return {"suite": "fp16_decode", "batch": batch, "context": context, "ms_attention_step": attn,
            "ms_gemms_step": gemm, "ms_step": whole, "tokens_per_s": batch / (whole * 1e-3),
            "attention_gbps": kv_bytes / (attn * 1e-3) / 1e9}


def prefill(batch, tokens, wts, reps):
    layers = 4  # timed over 4 layers, scaled to 32
    x = torch.randn(batch * tokens, HIDDEN, device="cuda", dtype=torch.float16)

    def run():
        for l in range(layers):
            qkv = x @ wts.qkv[l]
            q = qkv[:, :HIDDEN].reshape(batch, tokens, Q_HEADS, HEAD_DIM).transpose(1, 2)
            k = qkv[:, HIDDEN:HIDDEN + KV_HEADS * HEAD_DIM].reshape(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = qkv[:, HIDDEN + KV_HEADS * HEAD_DIM:].reshape(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            mlp(a.transpose(1, 2).reshape(batch * tokens, HIDDEN) @ wts.o[l], wts, l)

    ms = median_ms(run, reps) * LAYERS / layers
    return {"suite": "fp16_prefill", "batch": batch, "tokens": tokens, "ms_prefill": ms}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="8,32")
    p.add_argument("--contexts", default="8192")
    p.add_argument("--prefill", default="8x8192")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    wts = Weights(LAYERS)
    print(f"fp16 baseline on {torch.cuda.get_device_name()}, torch {torch.__version__}", file=sys.stderr)
    for context in [int(c) for c in a.contexts.split(",") if c]:  # --contexts '': the prefill alone
        for batch in [int(b) for b in a.batches.split(",") if b]:
            r = decode(batch, context, wts, a.steps)
            print(json.dumps(r), flush=True)
            if "skipped" in r:
                print(f"fp16 decode B={batch:3d} ctx={context:6d}: skipped, {r['skipped']}", file=sys.stderr)
                continue
            print(f"fp16 decode B={batch:3d} ctx={context:6d}: attention {r['ms_attention_step']:.2f} ms/step "
                  f"({r['attention_gbps']:.0f} GB/s), GEMMs {r['ms_gemms_step']:.2f}, step {r['ms_step']:.2f} ms, "
                  f"{r['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    if a.prefill:
        b, t = (int(v) for v in a.prefill.split("x"))
        r = prefill(b, t, wts, 3)
        print(json.dumps(r), flush=True)
        print(f"fp16 prefill {b}x{t}: {r['ms_prefill']:.1f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
