#!/usr/bin/env python3
"""Reads gpu_timeline.csv (tools/profile/gpu_timeline.cc) and prints where the GPU's time went in
the recorded span: how long no record of any stream ran (idle), each stream's busy time, the
kernels' times as they ran (concurrently), and the longest gaps in which no kernel ran, with the
record that ended before each, the one that began after (and its stream), and the copies and
memsets that ran during it (a kernel that waits for a copy queued behind another on the copy
engine shows as a gap that a large copy spans).

  gpu_timeline.py gpu_timeline.csv [--gaps 15] [--names 60]
"""
import argparse
import bisect
import collections
import shutil
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--gaps", type=int, default=15, help="longest idle gaps to list")
    ap.add_argument("--names", type=int, default=60, help="characters of a kernel's name")
    a = ap.parse_args()
    records = read(a.csv)
    if not records:
        print("no records")
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
        key = short(name, a.names) if k == "K" else name.rsplit(" ", 1)[0]
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
