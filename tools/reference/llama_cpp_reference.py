#!/usr/bin/env python3
"""Compares specache-run's tokenizer and logits with llama.cpp (through llama-cpp-python), an
implementation nobody here wrote, on the same GGUF file.

    tools/reference/compare.sh            # sets up the venv, builds, runs this script

Writes tests/data/smollm2_llama_cpp.json (token ids and the top logits llama.cpp gives: the
golden data of tests/tools/reference_model_test.cc, so CI checks against llama.cpp without
building it) and prints, per prompt, the top-1 tokens and the logit differences over the whole
vocabulary against `specache-run logits`.
"""
import argparse
import json
import subprocess
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama, __version__ as llama_cpp_version

# Tokenizer cases: plain English, digits, contractions, white space runs, code, non-ASCII text,
# and chat markup with special tokens.
TOKENIZER_CASES = [
    ("Hello world", False),
    ("The quick brown fox jumps over the lazy dog.", False),
    ("In 2024, 3.14159 and 1,000,000 were numbers; so was 42.", False),
    ("I'm sure they'll say it's fine, we've done what you'd expect.", False),
    ("  leading spaces\n\n\ttabs   and   runs  \n", False),
    ("def f(x):\n    return x ** 2  # square\n", False),
    ("Café naïve résumé — “quotes” and ‘apostrophes’ … ok", False),
    ("Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية", False),
    ("emoji 😀👍🏽 and symbols ©®™ ±×÷ ½ ² µ", False),
    ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|im_start|> is not special here", False),
]

LOGIT_PROMPTS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The GNU General Public License is a free, copyleft license for software and other kinds of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--specache-run", default="build/tools/specache-run")
    ap.add_argument("--golden", default="tests/data/smollm2_llama_cpp.json")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()

    llm = Llama(model_path=args.model, n_ctx=512, n_threads=2, logits_all=False, verbose=False)
    golden = {
        "generator": f"llama-cpp-python {llama_cpp_version} (tools/reference/llama_cpp_reference.py)",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "tokenizer": [],
        "logits": [],
    }
    for text, special in TOKENIZER_CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        golden["tokenizer"].append({"text": text, "special": special, "tokens": ids})

    failures = 0
    print(f"{'prompt':<34} {'tok':>4} {'top1 ref/ours':>14} {'max|dl|':>8} {'rms dl':>8} {'top-20 same':>11}")
    for prompt in LOGIT_PROMPTS:
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        # The last position's logits straight from llama.cpp's context (llm.scores stays empty
        # unless logits_all is set).
        ref = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1),
                                    shape=(llm.n_vocab(),)).astype(np.float64)
        top = np.argsort(-ref)[: args.top]
        golden["logits"].append({
            "prompt": prompt,
            "tokens": ids,
            "top": [[int(i), float(ref[i])] for i in top],
        })
        ours = json.loads(subprocess.run(
            [args.specache_run, "logits", "--model", args.model, "--prompt", prompt, "--raw-prompt"],
            check=True, capture_output=True, text=True).stdout)
        if ours["tokens"] != ids:
            print(f"tokenization differs for {prompt[:30]!r}: ours {ours['tokens'][:12]} ref {ids[:12]}")
            failures += 1
            continue
        mine = np.array(ours["logits"], dtype=np.float64)
        diff = np.abs(mine - ref)
        our_top = np.argsort(-mine)[: args.top]
        same_top = len(set(top.tolist()) & set(our_top.tolist()))
        ok = int(np.argmax(mine)) == int(np.argmax(ref))
        failures += not ok
        label = prompt.replace("\n", " ")[-32:]
        print(f"{label:<34} {len(ids):>4} {int(np.argmax(ref)):>6}/{int(np.argmax(mine)):<7} "
              f"{diff.max():>8.4f} {np.sqrt((diff ** 2).mean()):>8.4f} {same_top:>8}/{args.top}")
    tok_ok = 0
    for case in golden["tokenizer"]:
        ours = json.loads(subprocess.run(
            [args.specache_run, "logits", "--model", args.model, "--prompt", case["text"], "--raw-prompt"]
            + ([] if case["special"] else ["--no-special"]),
            check=True, capture_output=True, text=True).stdout)["tokens"]
        if ours == case["tokens"]:
            tok_ok += 1
        else:
            print(f"tokenizer differs on {case['text']!r}:\n  ours {ours}\n  ref  {case['tokens']}")
            failures += 1
    print(f"tokenizer: {tok_ok}/{len(golden['tokenizer'])} cases identical to llama.cpp")
    with open(args.golden, "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {args.golden}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
