#!/usr/bin/env python3
"""Where a program's CUDA calls come from, from tools/profile/null_cuda.cc's call sites.

    null_cuda_sites.py SITES [--base SITES_OF_A_SHORTER_RUN] [--per N] [--depth D] [--binary DIR_OR_FILE ...]

SITES is the file SPECACHE_NULL_CUDA_SITES named in a run under the null CUDA runtime: per call
site, the kind of call, how often it was made and its return addresses. They are named as
host_profile.py names a sample's frames (inline chains; --binary: the build's unstripped
programs), and the calls are summed per kind and per chain of the D innermost named functions
(default 3). --base subtracts a run that differs only in its number of steps (the calls of the
set-up and the teardown cancel out) and --per divides by the steps between the two runs (or by
steps x layers: the calls a decode layer makes).
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_profile  # noqa: E402


def read_sites(path):
    """The memory map and [(kind, count, [pc, ...])]."""
    maps, sites = [], []
    with open(path) as f:
        for line in f:
            if line.startswith("map "):
                m = host_profile.parse_map_line(line)
                if m:
                    maps.append(m)
            elif line.startswith("site "):
                kind, rest = line[5:].rstrip("\n").split("\t")
                fields = rest.split()
                sites.append((kind, int(fields[0]), [int(x, 16) for x in fields[1:]]))
    maps.sort()
    return maps, sites


def totals(path, binaries, depth):
    """{(kind, chain of the `depth` innermost function names): calls}."""
    maps, sites = read_sites(path)
    stacks = host_profile.symbolize(maps, [pcs for _, _, pcs in sites], binaries)
    out = collections.Counter()
    for (kind, n, _), names in zip(sites, stacks):
        chain = []
        for fn in names:
            if not chain or chain[-1] != fn:
                chain.append(fn)
        out[(kind, tuple(chain[:depth]))] += n
    return out


def short(name, width=70):
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sites")
    ap.add_argument("--base", help="the sites of a run with fewer steps, subtracted")
    ap.add_argument("--per", type=float, default=1.0, help="divide by this (steps, or steps x layers)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--binary", action="append", default=[])
    a = ap.parse_args()
    calls = totals(a.sites, a.binary, a.depth)
    if a.base:
        calls.subtract(totals(a.base, a.binary, a.depth))
    by_kind = collections.defaultdict(list)
    for (kind, chain), n in calls.items():
        if n:
            by_kind[kind].append((n, chain))
    grand = sum(n for rows in by_kind.values() for n, _ in rows)
    print(f"{grand / a.per:.2f} calls (per {a.per:g})")
    for kind, rows in sorted(by_kind.items(), key=lambda kv: -sum(n for n, _ in kv[1])):
        print(f"\n{sum(n for n, _ in rows) / a.per:8.2f}  {kind}")
        for n, chain in sorted(rows, key=lambda r: -r[0]):
            print(f"  {n / a.per:8.2f}  " + " <- ".join(short(fn) for fn in chain))


if __name__ == "__main__":
    main()
