#!/usr/bin/env python3
"""Means of kernel variants' `specache-bench attend` or `step` rounds, against a baseline variant.

gpu_agent_checks.sh's `variants` stage writes one file per (variant, context, round):
OUT/variant_NAME_CONTEXT_ROUND.txt, each `specache-bench-NAME attend` output, whose rows read

    batch   bits    ms_attend   us_enqueue      ms_topk ms_topk_mass ms_topk_flat  ...

or, with VARIANT_SUITE=step, each `specache-bench-NAME step` output, whose rows read

    kv                                   batch     ms_layers  ms_no_fetch     ms_fetch     ratio  ...

This prints, per (batch, context) and variant, the mean over its rounds of each row's times (the
attention and the three top-k times a layer, or the step's layers, without and with the fetch),
each with its change against the baseline's mean (default v0), and how many rounds each mean
holds (a variant that failed a round has fewer). Rows of other bit widths (attend) or replicas
(step) are kept apart by their `bits` or `kv` column.

    tools/bench/variant_means.py OUT [--baseline v0]
"""

import argparse
import collections
import pathlib
import re
import sys

FILE = re.compile(r"^variant_(?P<name>.+)_(?P<context>\d+)_(?P<round>\d+)\.txt$")
# A row kind: its pattern, the name of the column that keeps its rows apart (bits or kv), its
# times' groups and their printed heads, and what a time is of.
Kind = collections.namedtuple("Kind", "row apart columns heads unit")
KINDS = (
    Kind(re.compile(r"^\s*(?P<batch>\d+)\s+(?P<bits>\S+)\s+(?P<attend>[\d.]+)\s+[\d.]+\s+(?P<topk>[\d.]+)\s+"
                    r"(?P<mass>[\d.]+)\s+(?P<flat>[\d.]+)\s"),
         "bits", ("attend", "topk", "mass", "flat"), ("ms_attend", "ms_topk", "ms_topk_mass", "ms_topk_flat"), "a layer"),
    Kind(re.compile(r"^(?P<kv>(?:specache|kivi)\S*)\s+(?P<batch>\d+)\s+(?P<layers>[\d.]+)\s+(?P<no_fetch>[\d.]+)\s+"
                    r"(?P<fetch>[\d.]+)\s+[\d.]+\s"),
         "kv", ("layers", "no_fetch", "fetch"), ("ms_layers", "ms_no_fetch", "ms_fetch"), "a step"),
)


def read_rounds(out_dir):
    """{(context, batch, bits or kv, kind index): {variant: [[time per column] per round]}}"""
    table = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(pathlib.Path(out_dir).iterdir()):
        match = FILE.match(path.name)
        if not match:
            continue
        for line in path.read_text(errors="replace").splitlines():
            for k, kind in enumerate(KINDS):
                row = kind.row.match(line)
                if row:
                    key = (int(match["context"]), int(row["batch"]), row[kind.apart], k)
                    table[key][match["name"]].append([float(row[c]) for c in kind.columns])
                    break
    return table


def report(table, baseline):
    lines = []
    for (context, batch, apart, k) in sorted(table):
        kind = KINDS[k]
        variants = table[(context, batch, apart, k)]
        base = variants.get(baseline)
        base_mean = [sum(r[i] for r in base) / len(base) for i in range(len(kind.columns))] if base else None
        lines.append(f"{batch} x {context} ({apart}), ms {kind.unit}, mean of rounds"
                     + (f", change against {baseline}" if base_mean else f" ({baseline} not measured)"))
        names = sorted(variants, key=lambda n: (n != baseline, n))
        for name in names:
            rounds = variants[name]
            mean = [sum(r[i] for r in rounds) / len(rounds) for i in range(len(kind.columns))]
            cells = []
            for i, head in enumerate(kind.heads):
                change = f" ({(mean[i] / base_mean[i] - 1) * 100:+.1f}%)" if base_mean and base_mean[i] > 0 else ""
                cells.append(f"{head} {mean[i]:.4f}{change}")
            lines.append(f"  {name:<12} {len(rounds)} rounds  " + "  ".join(cells))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the directory of the variant_NAME_CONTEXT_ROUND.txt files")
    parser.add_argument("--baseline", default="v0", help="the variant the changes are against (default v0)")
    args = parser.parse_args(argv)
    table = read_rounds(args.out)
    if not table:
        print(f"variant_means: no variant_NAME_CONTEXT_ROUND.txt rows in {args.out}", file=sys.stderr)
        return 1
    print("\n".join(report(table, args.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
