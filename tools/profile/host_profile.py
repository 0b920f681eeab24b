#!/usr/bin/env python3
"""Where a host thread spent its time, from tools/profile/host_sampler.cc's samples.

    host_profile.py SAMPLES [--binary DIR_OR_FILE ...] [--top N] [--within FUNCTION] [--focus FUNCTION]

Each sampled return address is placed in its module through the run's memory map and named with
addr2line against a local, unstripped copy of that module given with --binary (the build's
programs, whose stripped copies ran on the GPU machine: --binary build/tools/specache-run); any
other module (the C library, the driver's libcuda) is named by its file. Prints the share of samples per function,
inclusive (the function anywhere on the stack, counted once per sample) and self (the innermost
named frame), and with --focus the callers and callees of one function; --within keeps only the
samples with that function on the stack (e.g. GpuEngine::RunStep: the decode steps, not the
setup or the teardown). The self time spent inside modules named only by their file (the C
library's memcpy, the driver's launches and waits: their frames say nothing of who called them)
is then charged to the first frame of a named module below them, per module.
"""
import argparse
import bisect
import collections
import os
import subprocess
import sys


def read(path):
    maps, samples = [], []
    with open(path) as f:
        for line in f:
            if line.startswith("map "):
                parts = line[4:].split()
                if len(parts) < 6 or "x" not in parts[1]:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi, int(parts[2], 16), parts[5]))
            elif line.startswith("s"):
                samples.append([int(x, 16) for x in line.split()[1:]])
    maps.sort()
    return maps, samples


def local_copy(module, binaries):
    base = os.path.basename(module)
    for b in binaries:
        if os.path.isfile(b) and os.path.basename(b) == base:
            return b
        if os.path.isdir(b) and os.path.isfile(os.path.join(b, base)):
            return os.path.join(b, base)
    return None  # named by its file: a module of the machine that ran may differ from the local one


def symbolize(maps, samples, binaries, unnamed=None):
    """Each sample's frames as function names; modules without a local copy are named by their
    file, and those names are added to `unnamed` (a set) when given."""
    starts = [m[0] for m in maps]
    where = {}  # pc -> (module, file address)
    for s in samples:
        for pc in s:
            if pc in where:
                continue
            i = bisect.bisect_right(starts, pc) - 1
            if i >= 0 and maps[i][0] <= pc < maps[i][1]:
                lo, _, off, module = maps[i]
                # A return address points after the call: look up the call itself.
                where[pc] = (module, pc - lo + off - 1)
            else:
                where[pc] = ("?", pc)
    names = {}
    by_module = collections.defaultdict(set)
    for pc, (module, addr) in where.items():
        by_module[module].add(addr)
    for module, addrs in by_module.items():
        copy = local_copy(module, binaries) if module != "?" else None
        addrs = sorted(addrs)
        label = os.path.basename(module)
        if copy is None:
            if unnamed is not None:
                unnamed.add(label)
            for a in addrs:
                names[(module, a)] = label
            continue
        out = subprocess.run(["addr2line", "-f", "-C", "-e", copy] + [hex(a) for a in addrs],
                             capture_output=True, text=True).stdout.splitlines()
        for k, a in enumerate(addrs):
            fn = out[2 * k] if 2 * k < len(out) else "??"
            names[(module, a)] = fn if fn != "??" else label
    return [[names[where[pc]] for pc in s] for s in samples]


def charge_to_callers(stacks, unnamed):
    """For the samples whose innermost frame is in a module named only by its file: per such
    module, how many samples, and a Counter of the first frame below its frames that is not in one
    ("?" when the whole stack is)."""
    by_module = collections.defaultdict(collections.Counter)
    for st in stacks:
        if not st or st[0] not in unnamed:
            continue
        k = 0
        while k < len(st) and st[k] in unnamed:
            k += 1
        by_module[st[0]][st[k] if k < len(st) else "?"] += 1
    return by_module


def short(name, width=110):
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples")
    ap.add_argument("--binary", action="append", default=[], help="unstripped local copy of a module (file or folder)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--focus", action="append", default=[], help="substring of a function: its callers and callees")
    ap.add_argument("--within", help="substring of a function: only the samples with it on the stack")
    a = ap.parse_args()
    maps, samples = read(a.samples)
    if not samples:
        sys.exit("no samples")
    unnamed = set()
    stacks = symbolize(maps, samples, a.binary, unnamed)
    if a.within:
        total = len(stacks)
        stacks = [st for st in stacks if any(a.within in fn for fn in st)]
        print(f"{len(stacks)} of {total} samples within {a.within}")
        if not stacks:
            sys.exit("no samples within " + a.within)
    n = len(stacks)
    incl, self_ = collections.Counter(), collections.Counter()
    for st in stacks:
        for fn in set(st):
            incl[fn] += 1
        if st:
            self_[st[0]] += 1
    print(f"{n} samples")
    print("\n== inclusive (share of samples with the function on the stack)")
    for fn, c in incl.most_common(a.top):
        print(f"{100.0 * c / n:6.1f}%  {short(fn)}")
    print("\n== self (innermost frame)")
    for fn, c in self_.most_common(a.top):
        print(f"{100.0 * c / n:6.1f}%  {short(fn)}")
    charged = charge_to_callers(stacks, unnamed)
    if charged:
        print("\n== self time in modules named by file, charged to the first named frame below")
        for module, callers in sorted(charged.items(), key=lambda kv: -sum(kv[1].values())):
            print(f"{100.0 * sum(callers.values()) / n:6.1f}%  {module}")
            for fn, c in callers.most_common(8):
                print(f"  {100.0 * c / n:6.1f}%  {short(fn)}")
    for focus in a.focus:
        callers, callees, hits = collections.Counter(), collections.Counter(), 0
        for st in stacks:
            idx = [i for i, fn in enumerate(st) if focus in fn]
            if not idx:
                continue
            hits += 1
            i = idx[-1]  # the outermost frame of it
            if i + 1 < len(st):
                callers[st[i + 1]] += 1
            j = idx[0]
            callees[st[j - 1] if j > 0 else "(self)"] += 1
        print(f"\n== {focus}: {100.0 * hits / n:.1f}% of samples; callers, then callees")
        for fn, c in callers.most_common(12):
            print(f"  caller {100.0 * c / n:6.1f}%  {short(fn)}")
        for fn, c in callees.most_common(20):
            print(f"  callee {100.0 * c / n:6.1f}%  {short(fn)}")


if __name__ == "__main__":
    main()
