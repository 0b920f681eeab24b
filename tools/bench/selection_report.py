#!/usr/bin/env python3
"""Tables of tools/bench/selection_grid.sh's runs: OUT/selection.json and OUT/selection.md.

  selection_report.py OUT

Per mode and rule (named from the runs' JSON, not from specache-run's labels, which depend on its
defaults): NIAH accuracy by length and overall, fetched bytes per
decode step and their ratio to the paper's rule (select=spec, k=64, nothing but the selection
attended), rows selected and fetched per (layer, KV head) and step, device KV bytes; per fidelity
context: top-1 agreement with full, mean KL, the same fetch figures. Missing runs show as "-".
"""
import glob
import json
import os
import sys


def is_paper_rule(run):
    return (run.get("kv") == "specache" and run.get("key_bits") == 1 and run.get("value_bits") == 1
            and run.get("select") == "spec" and not run.get("attend_resident") and run.get("mass", 0) == 0
            and run.get("topk") == 64 and not run.get("seed_rows"))


def rule(run):
    """A name for the run's KV mode and selection rule that does not depend on specache-run's
    defaults (its labels name what differs from them)."""
    kv = run.get("kv", run["mode"])
    if kv in ("full",):
        return "full"
    name = f"{kv}-{run['key_bits']}bit" if run.get("key_bits") == run.get("value_bits") else run["mode"]
    if "select" not in run:
        return name
    if kv == "specache":
        name += f" {run['select']}"
    name += f" k={run['topk']}" if not run.get("mass") else f" mass={run['mass']} k={run['k_min']}..{run['k_max']}"
    if kv == "specache" and run["select"] == "union":
        name += f"+{run['topk_real']}"
    if kv == "specache" and run["select"] != "spec" and run.get("real_next"):
        name += " next"
    name += " resident" if run.get("attend_resident") else ""
    name += f" cache={run['cached_rows']}"
    if run.get("seed_rows"):
        name += f" seed={run['seed_rows']}"
    if run.get("host_rows", "none") != "none":
        name += f" host-rows={run['host_rows']}"
    return name


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def main():
    out = sys.argv[1]
    niah_runs = []
    for path in sorted(glob.glob(os.path.join(out, "runs", "niah_*", "niah_grid.json"))):
        with open(path) as f:
            niah_runs += json.load(f)["runs"]
    fidelity_runs = []
    for path in sorted(glob.glob(os.path.join(out, "runs", "fidelity_*.jsonl"))):
        with open(path) as f:
            fidelity_runs += [json.loads(line) for line in f if line.strip()]

    for r in niah_runs + fidelity_runs:
        r["label"], r["mode"] = r["mode"], rule(r)
    order = []
    for r in niah_runs + fidelity_runs:
        if r["mode"] not in order:
            order.append(r["mode"])
    lengths = sorted({r["context_tokens"] for r in niah_runs})
    # niah: the prompt's length varies a little around the asked length; group by the asked one.
    asked = sorted({int(os.path.basename(os.path.dirname(p)).split("_")[1])
                    for p in glob.glob(os.path.join(out, "runs", "niah_*", "niah_grid.json"))})

    def asked_length(run):
        return min(asked, key=lambda a: abs(a - run["context_tokens"])) if asked else run["context_tokens"]

    paper = [r for r in niah_runs if is_paper_rule(r)]
    paper_bytes = mean([r.get("fetch_bytes_per_step") for r in paper])
    contexts = sorted({r["context_tokens"] for r in fidelity_runs})
    paper_fid = {c: mean([r.get("fetch_bytes_per_step") for r in fidelity_runs
                          if is_paper_rule(r) and r["context_tokens"] == c]) for c in contexts}

    summary = []
    for mode in order:
        runs = [r for r in niah_runs if r["mode"] == mode]
        entry = {"mode": mode}
        if runs:
            entry["selection"] = runs[0].get("selection")
            by_length = {}
            for a in asked:
                hits = [1.0 if r["correct"] else 0.0 for r in runs if asked_length(r) == a]
                by_length[str(a)] = mean(hits)
            entry["niah_by_length"] = by_length
            entry["niah_accuracy"] = mean([1.0 if r["correct"] else 0.0 for r in runs])
            entry["niah_points"] = len(runs)
            entry["fetch_bytes_per_step"] = mean([r.get("fetch_bytes_per_step") for r in runs])
            if paper_bytes and entry["fetch_bytes_per_step"] is not None:
                entry["fetch_bytes_vs_paper_rule"] = entry["fetch_bytes_per_step"] / paper_bytes
            entry["rows_selected_per_head_step"] = mean([r.get("rows_selected_per_head_step") for r in runs])
            entry["rows_fetched_per_head_step"] = mean([r.get("rows_fetched_per_head_step") for r in runs])
            entry["device_kv_bytes"] = mean([r.get("device_kv_bytes") for r in runs])
            entry["device_to_fp16_ratio"] = mean([r.get("device_to_fp16_ratio") for r in runs])
        fid = {}
        for r in fidelity_runs:
            if r["mode"] != mode:
                continue
            c = r["context_tokens"]
            fid[str(c)] = {k: r.get(k) for k in ("top1_agreement", "mean_kl", "max_kl", "fetch_bytes_per_step",
                                                 "rows_selected_per_head_step", "rows_fetched_per_head_step",
                                                 "device_kv_bytes", "speculative_token_hits", "positions")}
            if paper_fid.get(c) and r.get("fetch_bytes_per_step") is not None:
                fid[str(c)]["fetch_bytes_vs_paper_rule"] = r["fetch_bytes_per_step"] / paper_fid[c]
            entry.setdefault("selection", r.get("selection"))
        if fid:
            entry["fidelity"] = fid
        summary.append(entry)

    with open(os.path.join(out, "selection.json"), "w") as f:
        json.dump({"summary": summary, "niah_runs": niah_runs, "fidelity_runs": fidelity_runs}, f, indent=1)

    lines = ["# Row selection: NIAH and fidelity", "",
             "Bytes: fetched per decode step (all layers and KV heads), and their ratio to the paper's rule "
             "(select=spec, k=64, only the selection attended). Rows: per (layer, KV head) and step.", "",
             "## Needle in a haystack (PINEAPPLE in GPL-3)", ""]
    head = ["mode"] + [str(a) for a in asked] + ["all", "bytes/step", "x paper", "rows sel", "rows fetched",
                                                  "device MiB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary:
        if "niah_accuracy" not in e:
            continue
        row = [e["mode"]] + [fmt(e["niah_by_length"].get(str(a))) for a in asked]
        row += [fmt(e["niah_accuracy"]), fmt(e["fetch_bytes_per_step"], 0), fmt(e.get("fetch_bytes_vs_paper_rule")),
                fmt(e["rows_selected_per_head_step"], 1), fmt(e["rows_fetched_per_head_step"], 1),
                fmt(e["device_kv_bytes"] / 2**20 if e["device_kv_bytes"] is not None else None)]
        lines.append("| " + " | ".join(row) + " |")
    for c in contexts:
        lines += ["", f"## Fidelity at {c} tokens (teacher-forced, vs full)", ""]
        head = ["mode", "top-1 agreement", "mean KL", "bytes/step", "x paper", "rows sel", "rows fetched",
                "device MiB"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in summary:
            f = e.get("fidelity", {}).get(str(c))
            if not f:
                continue
            dev = f.get("device_kv_bytes")
            lines.append("| " + " | ".join([e["mode"], fmt(f.get("top1_agreement"), 3), fmt(f.get("mean_kl"), 4),
                                             fmt(f.get("fetch_bytes_per_step"), 0),
                                             fmt(f.get("fetch_bytes_vs_paper_rule")),
                                             fmt(f.get("rows_selected_per_head_step"), 1),
                                             fmt(f.get("rows_fetched_per_head_step"), 1),
                                             fmt(dev / 2**20 if dev is not None else None)]) + " |")
    with open(os.path.join(out, "selection.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}/selection.json and {out}/selection.md", file=sys.stderr)


if __name__ == "__main__":
    main()
