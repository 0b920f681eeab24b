#!/usr/bin/env python3
"""Reads gpu_timeline.csv (tools/profile/gpu_timeline.cc) and prints where the GPU's time went in
the recorded span: how long no record of any stream ran (idle), each stream's busy time, the
kernels' times as they ran (concurrently), and the longest gaps in which no kernel ran, with the
record that ended before each, the one that began after (and its stream), and the copies and
memsets that ran during it (a kernel that waits for a copy queued behind another on the copy
engine shows as a gap that a large copy spans).

With --steps MARKER (a kernel name's part, e.g. EmbedKernel: a record that begins each step) it
prints the steps instead (a span recorded to the exit, SPECACHE_TIMELINE_STOP=0): each step's
time (marker to marker), and over --count steps (0: all) after the first --skip: the kernels'
time per step, and the marker's stream's waits, each gap between its records charged to what it
waited for: the record of another stream whose end is nearest the moment the stream went on
(within --slack us either side), else the host (nothing ended there: the next launch came late).

With --overlap NAME (a kernel name's part, e.g. LowBitDecodeKernel) it prints, for the kernels so
named, how long they ran with no record of another stream beside them and how long beside each
other stream's record (by its name: a kernel that runs longer beside the fetch's kernels or copies
than alone is slowed by them), and the share of each launch the other record overlapped.

  gpu_timeline.py gpu_timeline.csv [--gaps 15] [--names 60] [--steps MARKER [--skip 2] [--count 0] [--slack 4]]
                  [--overlap NAME]
"""
import argparse
import bisect
import collections
import shutil
import statistics
import subprocess


def read(path):
    records = []
    with open(path) as f:
        next(f)  # header
        for line in f:
            kind, stream, start, end, name = line.rstrip("\n").split(",", 4)
            records.append((int(start), int(end), kind, int(stream), name))
    records.sort()
    return demangled(records)


def demangled(records):
    """Kernel names through c++filt where it is installed (CUPTI gives them mangled)."""
    names = sorted({r[4] for r in records if r[2] == "K"})
    if not names or not shutil.which("c++filt"):
        return records
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    plain = dict(zip(names, out))
    return [(s, e, k, st, plain.get(n, n) if k == "K" else n) for s, e, k, st, n in records]


def union(intervals):
    """Merged [start, end) intervals of a sorted list."""
    merged = []
    for s, e in intervals:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def copies_during(records, start, end):
    """The copies and memsets that ran for some of [start, end)."""
    return [r for r in records if r[2] != "K" and r[0] < end and r[1] > start]


def short(name, width):
    for noise in ("void ", "specache::", "(anonymous namespace)::", "<unnamed>::"):
        name = name.replace(noise, "")
    name = name.split("(")[0]
    return name[:width]


def label(kind, name, width):
    """What the tables call a record: a kernel's short name, a copy's or memset's kind (its size
    dropped)."""
    return short(name, width) if kind == "K" else name.rsplit(" ", 1)[0]


def steps_report(records, marker, skip, count, slack_us, width):
    """The per-step view of --steps (see the module's text)."""
    starts = [r for r in records if r[2] == "K" and marker in r[4]]
    recorded = len(starts) - 1  # whole steps: marker to marker
    if count:
        starts = starts[: skip + count + 1]
    if len(starts) < skip + 2:
        print(f"{len(starts)} records named like {marker!r}: too few steps for --skip {skip}")
        return
    stream = starts[0][3]
    edges = [r[0] for r in starts]
    print(f"{recorded} whole steps recorded ({marker} on stream {stream} begins each); the first "
          f"{len(edges) - 1}, ms each:")
    print("  " + " ".join(f"{(b - a) / 1e6:.2f}" for a, b in zip(edges, edges[1:])))
    lo, hi = edges[skip], edges[-1]
    n = len(edges) - 1 - skip
    inside = [r for r in records if lo <= r[0] < hi]
    kernels = union([(s, e) for s, e, k, *_ in inside if k == "K"])
    own = union([(s, e) for s, e, k, st, _ in inside if st == stream])
    print(f"\nsteps {skip + 1}-{len(edges) - 1} ({n}): {(hi - lo) / 1e6 / n:.3f} ms a step; kernels on any stream "
          f"{sum(e - s for s, e in kernels) / 1e6 / n:.3f}, on stream {stream} {sum(e - s for s, e in own) / 1e6 / n:.3f}")
    by_name = collections.defaultdict(lambda: [0, 0])
    for s, e, k, st, name in inside:
        key = (label(k, name, width), st)
        by_name[key][0] += 1
        by_name[key][1] += e - s
    print("\n ms/step  launches/step   us_each  stream  record")
    for (name, st), (cnt, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{ns / 1e6 / n:8.3f} {cnt / n:14.1f} {ns / cnt / 1e3:9.2f} {st:7d}  {name}")
    # The marker stream's gaps, each charged to the other stream's record whose end is nearest the
    # moment the stream went on, within the slack either side (engines stamp their own clocks: a
    # copy's end may read a little after the kernel that waited for it began), a wait on an event
    # of that stream; else to the host.
    mine = sorted(r for r in records if r[3] == stream and lo <= r[0] <= hi)  # to the last marker, whole
    others = sorted((r for r in records if r[3] != stream), key=lambda r: r[1])
    other_ends = [r[1] for r in others]
    charged = collections.defaultdict(lambda: [0, 0])
    slack = slack_us * 1000
    for prev, nxt in zip(mine, mine[1:]):
        gap = nxt[0] - prev[1]
        if gap <= slack:
            continue
        window = range(bisect.bisect_left(other_ends, max(prev[1] + 1, nxt[0] - slack)),
                       bisect.bisect_right(other_ends, nxt[0] + slack))
        i = min(window, key=lambda j: abs(other_ends[j] - nxt[0]), default=-1)
        cause = "the host (no other stream's record ended just before)"
        if i >= 0:
            o = others[i]
            cause = f"{label(o[2], o[4], width)} (stream {o[3]})"
        charged[(cause, short(nxt[4], 40))][0] += 1
        charged[(cause, short(nxt[4], 40))][1] += gap
    total = sum(ns for _, ns in charged.values())
    print(f"\nstream {stream}'s gaps over {slack_us:g} us: {total / 1e6 / n:.3f} ms a step, by what it waited for -> what ran next")
    for (cause, nxt), (cnt, ns) in sorted(charged.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{ns / 1e6 / n:8.3f} ms/step {cnt / n:6.1f}/step  {cause} -> {nxt}")


def overlap_report(records, part, width):
    """The --overlap view (see the module's text)."""
    mine = [r for r in records if r[2] == "K" and part in r[4]]
    if not mine:
        print(f"no kernel named like {part!r}")
        return
    us = lambda ns: ns / 1e3
    alone = []
    beside = collections.defaultdict(list)  # other record's label -> [(duration, overlapped ns)]
    for s, e, _, st, _ in mine:
        over = collections.defaultdict(int)
        for s2, e2, k2, st2, n2 in records:  # by start (read sorts them)
            if s2 >= e:
                break
            if st2 != st and e2 > s:
                over[label(k2, n2, width)] += min(e, e2) - max(s, s2)
        if not over:
            alone.append(e - s)
        for name, ns in over.items():
            beside[name].append((e - s, ns))
    durations = [e - s for s, e, *_ in mine]
    print(f"{len(mine)} launches named like {part!r}: mean {us(statistics.mean(durations)):.1f} us, median "
          f"{us(statistics.median(durations)):.1f}")
    if alone:
        print(f"  alone (no other stream's record beside): {len(alone)} launches, mean {us(statistics.mean(alone)):.1f} us,"
              f" median {us(statistics.median(alone)):.1f}")
    else:
        print("  alone (no other stream's record beside): none")
    print("  beside another stream's record (a launch may count under several):")
    print("  launches   mean_us  median_us  overlapped_mean_us  record")
    for name, v in sorted(beside.items(), key=lambda kv: -len(kv[1])):
        d = [x for x, _ in v]
        print(f"  {len(v):8d} {us(statistics.mean(d)):9.1f} {us(statistics.median(d)):10.1f} "
              f"{us(statistics.mean(o for _, o in v)):19.1f}  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--gaps", type=int, default=15, help="longest idle gaps to list")
    ap.add_argument("--names", type=int, default=60, help="characters of a kernel's name")
    ap.add_argument("--steps", help="a part of the name of the kernel that begins each step: the per-step view")
    ap.add_argument("--skip", type=int, default=2, help="--steps: first steps left out (the profiled one, warm-up)")
    ap.add_argument("--count", type=int, default=0, help="--steps: steps looked at after those (0: all)")
    ap.add_argument("--slack", type=float, default=4.0, help="--steps: us between an end and a start that count as a wait")
    ap.add_argument("--overlap", help="a part of a kernel's name: those kernels' times alone and beside other streams' records")
    a = ap.parse_args()
    records = read(a.csv)
    if not records:
        print("no records")
        return
    if a.overlap:
        overlap_report(records, a.overlap, a.names)
        return
    if a.steps:
        steps_report(records, a.steps, a.skip, a.count, a.slack, a.names)
        return
    t0, t1 = records[0][0], max(r[1] for r in records)
    span = (t1 - t0) / 1e6
    busy = union([(s, e) for s, e, *_ in records])
    busy_ms = sum(e - s for s, e in busy) / 1e6
    kernels = union([(s, e) for s, e, k, *_ in records if k == "K"])
    kernel_ms = sum(e - s for s, e in kernels) / 1e6
    print(f"{len(records)} records over {span:.3f} ms: something ran {busy_ms:.3f} ms ({busy_ms / span:.1%}), "
          f"kernels {kernel_ms:.3f} ms ({kernel_ms / span:.1%}); nothing ran {span - busy_ms:.3f} ms")

    per_stream = collections.defaultdict(list)
    for s, e, k, st, _ in records:
        per_stream[st].append((s, e))
    print("\nstream  records   busy_ms  (union of its records)")
    for st, iv in sorted(per_stream.items(), key=lambda kv: -sum(e - s for s, e in kv[1])):
        print(f"{st:6d} {len(iv):8d} {sum(e - s for s, e in union(iv)) / 1e6:9.3f}")

    by_name = collections.defaultdict(lambda: [0, 0])
    for s, e, k, st, name in records:
        key = label(k, name, a.names)
        by_name[key][0] += 1
        by_name[key][1] += e - s
    print("\n     ms  launches   us_each  record (as run, concurrently)")
    for name, (n, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{ns / 1e6:7.3f} {n:9d} {ns / n / 1e3:9.2f}  {name}")

    # The SMs' idle gaps: between consecutive intervals of the kernels' union (copies run on the
    # copy engines, beside or without kernels).
    gaps = [(kernels[i + 1][0] - kernels[i][1], kernels[i][1], kernels[i + 1][0]) for i in range(len(kernels) - 1)]
    sizes = [g for g, *_ in gaps]
    print("\nno kernel running, gaps: " + ", ".join(
        f"{sum(1 for g in sizes if lo <= g < hi)} of {lo / 1e3:g}-{hi / 1e3:g} us ({sum(g for g in sizes if lo <= g < hi) / 1e6:.3f} ms)"
        for lo, hi in [(0, 2000), (2000, 10000), (10000, 100000), (100000, 10**12)]))
    ends = sorted(records, key=lambda r: r[1])
    print(f"\nlongest {a.gaps} of those gaps (us, at ms from the start): the record that ended before, the one that began after")
    end_times = [r[1] for r in ends]
    start_times = [r[0] for r in records]
    for g, s, e in sorted(gaps, reverse=True)[: a.gaps]:
        before = ends[bisect.bisect_right(end_times, s) - 1]
        after = records[bisect.bisect_left(start_times, e)]
        print(f"{g / 1e3:9.1f} @ {(s - t0) / 1e6:8.3f}  {short(before[4], 40):40s} -> {short(after[4], 40)}"
              f" (stream {after[3]})")
        for c in copies_during(records, s, e):
            print(f"{'':22s}during: {c[4]} on stream {c[3]}, {(c[0] - s) / 1e3:+.1f} to {(c[1] - s) / 1e3:+.1f} us")


if __name__ == "__main__":
    main()
