#!/usr/bin/env python3
"""A second, float64 reference for the Llama forward: numpy, with the weights dequantized by the
`gguf` package (llama.cpp's own Python reader), not by our C++ code. llama.cpp quantizes
activations to 8 bits inside its Q4_1 products, so it cannot tell a small bug from its own
rounding; this reference can (expected agreement with specache-run: ~1e-3).

    .venv-ref/bin/python tools/reference/numpy_reference.py --model M --prompt TEXT
"""
import argparse
import json
import subprocess
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--specache-run", default="build/tools/specache-run")
    args = ap.parse_args()

    r = GGUFReader(args.model)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml")}
    W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}
    n_layers, n_heads = meta["llama.block_count"], meta["llama.attention.head_count"]
    n_kv, eps = meta["llama.attention.head_count_kv"], meta["llama.attention.layer_norm_rms_epsilon"]
    theta = meta["llama.rope.freq_base"]
    emb = W["token_embd.weight"]
    d = emb.shape[1]
    hd = d // n_heads

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos):  # x [n][heads][hd], adjacent pairs
        inv = theta ** (-np.arange(0, hd, 2) / hd)
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    worst = 0.0
    for prompt in args.prompt:
        ours = json.loads(subprocess.run(
            [args.specache_run, "logits", "--model", args.model, "--prompt", prompt, "--raw-prompt"],
            check=True, capture_output=True, text=True).stdout)
        ids = np.array(ours["tokens"])
        n = len(ids)
        pos = np.arange(n, dtype=np.float64)
        x = emb[ids]
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for l in range(n_layers):
            p = f"blk.{l}."
            h = rms(x, W[p + "attn_norm.weight"])
            q = rope((h @ W[p + "attn_q.weight"].T).reshape(n, n_heads, hd), pos)
            k = rope((h @ W[p + "attn_k.weight"].T).reshape(n, n_kv, hd), pos)
            v = (h @ W[p + "attn_v.weight"].T).reshape(n, n_kv, hd)
            k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)  # fp16 cache
            out = np.empty((n, n_heads, hd))
            for hh in range(n_heads):
                g = hh // (n_heads // n_kv)
                s = q[:, hh] @ k[:, g].T / np.sqrt(hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, g]
            x = x + out.reshape(n, d) @ W[p + "attn_output.weight"].T
            h = rms(x, W[p + "ffn_norm.weight"])
            gate, up = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "ffn_down.weight"].T
        head = W.get("output.weight", emb)
        ref = rms(x[-1], W["output_norm.weight"]) @ head.T
        mine = np.array(ours["logits"])
        diff = np.abs(mine - ref).max()
        worst = max(worst, diff)
        print(f"{n:4d} tokens: top-1 numpy {ref.argmax()} ours {mine.argmax()}, max |logit diff| {diff:.2e} "
              f"(logit range {ref.min():.1f}..{ref.max():.1f})")
    return 0 if worst < 5e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
