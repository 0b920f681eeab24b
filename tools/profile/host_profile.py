#!/usr/bin/env python3
"""Where a host thread spent its time, from tools/profile/host_sampler.cc's samples.

    host_profile.py SAMPLES [--binary DIR_OR_FILE ...] [--top N] [--within FUNCTION] [--focus FUNCTION]

Each sampled return address is placed in its module through the run's memory map and named with
addr2line against a local, unstripped copy of that module given with --binary (the build's
programs, whose stripped copies ran on the GPU machine: --binary build/tools/specache-run), as
the chain of functions inlined there (innermost first), so a frame reads as the function whose
code it is, not only as the last helper inlined into it. A copy without debug information (the GPU
machine's C library, which the profile stage brings back) is named by its dynamic symbols
(`module:symbol`); any other module (the driver's libcuda) is named by its file. Prints the share
of samples per function, inclusive (the function anywhere on the stack, counted once per sample)
and self (the innermost named frame), and with --focus the callers and callees of one function; --within keeps only the
samples with that function on the stack (e.g. GpuEngine::RunStep: the decode steps, not the
setup or the teardown). The self time spent inside modules named only by their file (the C
library's memcpy, the driver's launches and waits: their frames say nothing of who called them)
is then charged to the first frame of a named module below them, per module.

Samples that carry the thread's CPU time (host_sampler.cc writes it) also give each function its
share of the thread's CPU time (a sample is weighed by the share of the wall time since the sample
before it that the thread ran): a function whose wall share is well above its CPU share spent that
time blocked (a lock held by another thread, a synchronisation), not computing.
"""
import argparse
import bisect
import collections
import os
import subprocess
import sys


def parse_map_line(line):
    """A `map ` line (a line of /proc/self/maps): (start, end, file offset, path) of an executable
    mapping of a file, else None."""
    parts = line[4:].split()
    if len(parts) < 6 or "x" not in parts[1]:
        return None
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    return (lo, hi, int(parts[2], 16), parts[5])


def read(path):
    """The memory map, the samples' return addresses and each sample's (cpu_ns, wall_ns) (None for
    a file written without them)."""
    maps, samples, times = [], [], []
    with open(path) as f:
        for line in f:
            if line.startswith("map "):
                m = parse_map_line(line)
                if m:
                    maps.append(m)
            elif line.startswith("s"):
                fields = line.split()[1:]
                cpu = wall = None
                while fields and fields[0][0] in "cw":
                    if fields[0][0] == "c":
                        cpu = int(fields[0][1:])
                    else:
                        wall = int(fields[0][1:])
                    fields = fields[1:]
                samples.append([int(x, 16) for x in fields])
                times.append((cpu, wall) if cpu is not None and wall is not None else None)
    maps.sort()
    return maps, samples, times


def cpu_weights(times):
    """Per sample, the share of the wall time since the sample before that the thread ran (0..1);
    None when the samples carry no times. The first sample is weighed as the second."""
    if not times or any(t is None for t in times):
        return None
    w = []
    for i in range(1, len(times)):
        dwall = times[i][1] - times[i - 1][1]
        dcpu = times[i][0] - times[i - 1][0]
        w.append(min(max(dcpu / dwall, 0.0), 1.0) if dwall > 0 else 0.0)
    return [w[0] if w else 1.0] + w


def parse_inline_chains(text):
    """addr2line -a -f -C -i output: {address: [innermost function, ..., outermost]}."""
    chains, current = {}, None
    lines = text.splitlines()
    k = 0
    while k < len(lines):
        line = lines[k]
        if line.startswith("0x"):
            current = int(line, 16)
            chains[current] = []
            k += 1
            continue
        if current is not None:
            chains[current].append(line)
        k += 2  # the function, then its file:line
    return chains


def parse_dynamic_symbols(text):
    """nm -D --defined-only output: sorted [(address, name)] of its functions."""
    syms = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TtWwi":
            syms.append((int(parts[0], 16), parts[2].split("@")[0]))
    syms.sort()
    return syms


def nearest_symbol(syms, addr, starts=None):
    """The name of the last of `syms` at or below `addr`; `starts`: their addresses, when the
    caller looks up many."""
    i = bisect.bisect_right(starts if starts is not None else [a for a, _ in syms], addr) - 1
    return syms[i][1] if i >= 0 else None


def local_copy(module, binaries):
    base = os.path.basename(module)
    for b in binaries:
        if os.path.isfile(b) and os.path.basename(b) == base:
            return b
        if os.path.isdir(b) and os.path.isfile(os.path.join(b, base)):
            return os.path.join(b, base)
    return None  # named by its file: a module of the machine that ran may differ from the local one


def symbolize(maps, samples, binaries, unnamed=None):
    """Each sample's frames as function names (a return address as its inline chain, innermost
    first); modules without a local copy are named by their file, and those names are added to
    `unnamed` (a set) when given."""
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
                names[(module, a)] = [label]
            continue
        out = subprocess.run(["addr2line", "-a", "-f", "-C", "-i", "-e", copy] + [hex(a) for a in addrs],
                             capture_output=True, text=True).stdout
        chains = parse_inline_chains(out)
        syms = starts = None
        for a in addrs:
            chain = [fn for fn in chains.get(a, []) if fn != "??"]
            if not chain:  # no debug information: the dynamic symbol below it
                if syms is None:
                    syms = parse_dynamic_symbols(subprocess.run(["nm", "-D", "--defined-only", copy],
                                                                capture_output=True, text=True).stdout)
                    starts = [s for s, _ in syms]
                sym = nearest_symbol(syms, a, starts)
                chain = [f"{label}:{sym}" if sym else label]
            names[(module, a)] = chain
    return [[fn for pc in s for fn in names[where[pc]]] for s in samples]


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
    maps, samples, times = read(a.samples)
    if not samples:
        sys.exit("no samples")
    weights = cpu_weights(times)
    unnamed = set()
    stacks = symbolize(maps, samples, a.binary, unnamed)
    if weights:
        print(f"the thread ran {100.0 * sum(weights) / len(weights):.1f}% of the sampled wall time")
    if a.within:
        total = len(stacks)
        keep = [i for i, st in enumerate(stacks) if any(a.within in fn for fn in st)]
        stacks = [stacks[i] for i in keep]
        weights = [weights[i] for i in keep] if weights else None
        print(f"{len(stacks)} of {total} samples within {a.within}")
        if not stacks:
            sys.exit("no samples within " + a.within)
        if weights:
            print(f"  the thread ran {100.0 * sum(weights) / len(weights):.1f}% of their wall time")
    n = len(stacks)
    incl, self_ = collections.Counter(), collections.Counter()
    incl_cpu, self_cpu = collections.Counter(), collections.Counter()
    for k, st in enumerate(stacks):
        w = weights[k] if weights else 0.0
        for fn in set(st):
            incl[fn] += 1
            incl_cpu[fn] += w
        if st:
            self_[st[0]] += 1
            self_cpu[st[0]] += w

    def share(fn, counts, cpu):  # wall share, then the CPU-time share where the samples carry it
        text = f"{100.0 * counts[fn] / n:6.1f}%"
        return text + (f" {100.0 * cpu[fn] / n:6.1f}%" if weights else "")

    print(f"{n} samples" + ("; columns: share of the wall time, share of it the thread ran" if weights else ""))
    print("\n== inclusive (share of samples with the function on the stack)")
    for fn, _ in incl.most_common(a.top):
        print(f"{share(fn, incl, incl_cpu)}  {short(fn)}")
    print("\n== self (innermost frame)")
    for fn, _ in self_.most_common(a.top):
        print(f"{share(fn, self_, self_cpu)}  {short(fn)}")
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
