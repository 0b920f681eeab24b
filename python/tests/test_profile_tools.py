"""The profile tools on small hand-made inputs. tools/profile/gpu_timeline.py: the idle gap
before a kernel is listed with the copies that ran during it, so a kernel waiting behind a large
copy shows; tools/profile/host_profile.py: time inside libraries is charged to their callers."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "profile" / "gpu_timeline.py"


def test_a_gap_lists_the_copies_that_ran_during_it(tmp_path):
    csv = tmp_path / "timeline.csv"
    csv.write_text(
        "kind,stream,start_ns,end_ns,name\n"
        "K,7,0,100000,FirstKernel\n"
        "C,9,50000,600000,copy HtoD 26214400\n"   # spans the gap
        "C,13,120000,130000,copy HtoD 65536\n"     # inside it
        "S,9,900000,910000,memset 64\n"            # after it: not listed
        "K,7,650000,700000,AttentionKernel\n"
        "K,7,702000,710000,MergeKernel\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(csv), "--gaps", "1"], capture_output=True, text=True,
                         check=True).stdout
    gap = out[out.index("longest 1 of those gaps"):].splitlines()
    assert "550.0" in gap[1] and "FirstKernel" in gap[1] and "AttentionKernel (stream 7)" in gap[1]
    assert gap[2].split() == ["during:", "copy", "HtoD", "26214400", "on", "stream", "9,", "-50.0", "to", "+500.0", "us"]
    assert gap[3].split()[1:4] == ["copy", "HtoD", "65536"]
    assert len(gap) == 4, out


def test_steps_charge_the_marker_streams_gaps_to_what_it_waited_for(tmp_path):
    """--steps: steps are cut at each marker kernel; a gap of the marker's stream that ends just
    after another stream's record is that record's wait, one with nothing ending there the host's."""
    csv = tmp_path / "timeline.csv"
    rows = ["kind,stream,start_ns,end_ns,name"]
    for step in range(4):  # 1 ms steps on stream 7
        t = step * 1_000_000
        rows += [f"K,7,{t},{t + 10_000},EmbedKernel",
                 f"K,7,{t + 10_000},{t + 400_000},Attention",
                 f"K,9,{t + 300_000},{t + 500_000},UpdateCache",      # stream 7 waits for it: 100 us
                 f"K,7,{t + 500_000},{t + 700_000},Gemm",
                 f"K,7,{t + 900_000},{t + 950_000},Gemm"]              # 200 us late, nothing ended: the host
    csv.write_text("\n".join(rows) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(csv), "--steps", "EmbedKernel", "--skip", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert "3 whole steps recorded" in out and "the first 3, ms each" in out and "1.00 1.00 1.00" in out, out
    assert "steps 2-3 (2): 1.000 ms a step" in out, out
    waits = out[out.index("stream 7's gaps"):].splitlines()
    assert "0.350 ms a step" in waits[0], out  # 100 + 200 + the step's last 50 us before the next marker
    assert waits[1].split()[:2] == ["0.200", "ms/step"] and "the host" in waits[1] and waits[1].endswith("-> Gemm"), out
    assert waits[2].split()[:2] == ["0.100", "ms/step"] and "UpdateCache (stream 9) -> Gemm" in waits[2], out
    one = subprocess.run([sys.executable, str(SCRIPT), str(csv), "--steps", "EmbedKernel", "--skip", "1", "--count", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert "3 whole steps recorded" in one and "the first 2, ms each" in one and "steps 2-2 (1)" in one, one


def test_overlap_splits_a_kernels_launches_by_what_ran_beside_them(tmp_path):
    """--overlap: launches of the named kernel with no other stream's record beside them count as
    alone; the others under each record that overlapped them, with the overlap's length."""
    csv = tmp_path / "timeline.csv"
    csv.write_text(
        "kind,stream,start_ns,end_ns,name\n"
        "K,7,0,80000,LowBitDecodeKernel\n"            # alone: 80 us
        "K,7,100000,190000,LowBitDecodeKernel\n"      # beside UpdateCache for 40 us and a copy for 10
        "K,9,150000,250000,UpdateCacheKernel\n"
        "C,13,120000,130000,copy HtoD 65536\n"
        "K,7,300000,400000,LowBitDecodeKernel\n"      # beside UpdateCache for 20 us
        "K,9,380000,420000,UpdateCacheKernel\n"
        "K,7,400000,410000,MergeKernel\n")            # not named: not counted
    out = subprocess.run([sys.executable, str(SCRIPT), str(csv), "--overlap", "LowBitDecode"], capture_output=True,
                         text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("3 launches named like 'LowBitDecode': mean 90.0 us, median 90.0"), out
    assert "alone (no other stream's record beside): 1 launches, mean 80.0 us" in lines[1], out
    update = next(l for l in lines if l.endswith("UpdateCacheKernel")).split()
    assert update[:4] == ["2", "95.0", "95.0", "30.0"], out
    copy = next(l for l in lines if l.endswith("copy HtoD")).split()
    assert copy[:4] == ["1", "90.0", "90.0", "10.0"], out
    missing = subprocess.run([sys.executable, str(SCRIPT), str(csv), "--overlap", "Nothing"], capture_output=True,
                             text=True, check=True).stdout
    assert "no kernel named like 'Nothing'" in missing


def _host_profile():
    sys.path.insert(0, str(REPO / "tools" / "profile"))
    try:
        import host_profile
    finally:
        sys.path.pop(0)
    return host_profile


def test_library_self_time_is_charged_to_the_named_caller():
    """tools/profile/host_profile.py: a sample whose innermost frames are in modules named only
    by their file (the C library, the driver) is charged to the first named frame below them."""
    host_profile = _host_profile()
    unnamed = {"libc.so.6", "libcuda.so.1"}
    stacks = [
        ["libc.so.6", "WriteItemSet", "AttendDecodeBatch", "main"],
        ["libc.so.6", "libcuda.so.1", "Launch", "main"],   # through the driver: charged past it
        ["libcuda.so.1", "RunStep", "main"],
        ["libcuda.so.1", "RunStep", "main"],
        ["WriteItemSet", "libc.so.6", "main"],            # a named innermost frame: not charged
        ["libc.so.6"],                                     # nothing named below
    ]
    charged = host_profile.charge_to_callers(stacks, unnamed)
    assert dict(charged["libc.so.6"]) == {"WriteItemSet": 1, "Launch": 1, "?": 1}
    assert dict(charged["libcuda.so.1"]) == {"RunStep": 2}
    assert set(charged) == {"libc.so.6", "libcuda.so.1"}


def test_samples_with_cpu_times_weigh_each_sample_by_the_share_the_thread_ran(tmp_path):
    """tools/profile/host_profile.py: host_sampler's `c<ns> w<ns>` fields are read apart from the
    addresses; a sample is weighed by the thread's CPU time over the wall time since the one before
    (the first as the second); a file without them has no weights."""
    hp = _host_profile()
    path = tmp_path / "samples.txt"
    path.write_text("map 400000-401000 r-xp 00000000 00:00 0 /bin/prog\n"
                    "s c1000 w10000 0x400010 0x400020\n"
                    "s c1500 w11000 0x400010\n"        # ran 500 of 1000 ns
                    "s c2500 w12000 0x400030\n"        # ran all of it
                    "s c2500 w14000 0x400030\n")       # blocked
    maps, samples, times = hp.read(str(path))
    assert samples == [[0x400010, 0x400020], [0x400010], [0x400030], [0x400030]]
    assert times == [(1000, 10000), (1500, 11000), (2500, 12000), (2500, 14000)]
    assert hp.cpu_weights(times) == [0.5, 0.5, 1.0, 0.0]
    old = tmp_path / "old.txt"
    old.write_text("s 0x400010\n")
    assert hp.read(str(old))[2] == [None] and hp.cpu_weights([None]) is None


def test_a_return_address_reads_as_its_inline_chain_or_its_dynamic_symbol():
    """addr2line -a -f -i output becomes each address's chain of functions, innermost first; nm -D's
    functions name an address of a module without debug information by the symbol below it."""
    hp = _host_profile()
    out = ("0x0000000000001234\nstd::vector<int>::size() const\n/usr/include/c++/12/bits/stl_vector.h:919\n"
           "Plan(int)\n/src/step_planner.cc:80\n"
           "0x0000000000002000\n??\n??:0\n")
    assert hp.parse_inline_chains(out) == {0x1234: ["std::vector<int>::size() const", "Plan(int)"], 0x2000: ["??"]}
    syms = hp.parse_dynamic_symbols("0000000000000100 T memcpy@@GLIBC_2.14\n0000000000000400 W pthread_mutex_lock\n"
                                    "0000000000000800 D some_data\n")
    assert syms == [(0x100, "memcpy"), (0x400, "pthread_mutex_lock")]
    assert hp.nearest_symbol(syms, 0x3ff) == "memcpy" and hp.nearest_symbol(syms, 0x500) == "pthread_mutex_lock"
    assert hp.nearest_symbol(syms, 0x50) is None


def test_null_cuda_sites_sum_calls_by_kind_and_caller_chain_and_subtract_a_shorter_run(tmp_path):
    """tools/profile/null_cuda_sites.py: per call site the kind, count and return addresses; calls
    summed per kind and chain of named callers, a shorter run's subtracted."""
    sys.path.insert(0, str(REPO / "tools" / "profile"))
    try:
        import null_cuda_sites
    finally:
        sys.path.pop(0)
    def write(name, lines):
        path = tmp_path / name
        path.write_text("map 400000-401000 r-xp 00000000 00:00 0 /bin/prog\n" + "".join(lines))
        return str(path)
    long_run = write("b.txt", ["site cudaEventRecord\t40 0x400010 0x400020\n",
                               "site cudaEventRecord\t8 0x400030 0x400020\n",
                               "site kernel launches (<<<>>>)\t20 0x400010 0x400020\n"])
    short_run = write("a.txt", ["site cudaEventRecord\t10 0x400010 0x400020\n",
                                "site kernel launches (<<<>>>)\t5 0x400010 0x400020\n"])
    maps, sites = null_cuda_sites.read_sites(long_run)
    assert maps == [(0x400000, 0x401000, 0, "/bin/prog")]
    assert sites[0] == ("cudaEventRecord", 40, [0x400010, 0x400020])
    # No local copy of /bin/prog: every frame is named by its file, so the chains collapse to one name.
    calls = null_cuda_sites.totals(long_run, [], 3)
    calls.subtract(null_cuda_sites.totals(short_run, [], 3))
    assert calls[("cudaEventRecord", ("prog",))] == 38
    assert calls[("kernel launches (<<<>>>)", ("prog",))] == 15
