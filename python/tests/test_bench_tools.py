"""tools/bench/variant_means.py on hand-made `specache-bench attend` and `step` outputs: each
variant's mean over its rounds, its change against the baseline, rows of other bit widths (or
replicas) kept apart, a round a variant lacks counted, and no rows at all an error."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "variant_means.py"
HEADER = "batch   bits    ms_attend   us_enqueue      ms_topk ms_topk_mass ms_topk_flat      MB_read        GBps     of_HBM\n"


def attend_output(rows):
    """specache-bench attend's table: rows of (batch, bits, ms_attend, ms_topk)."""
    lines = ["specache-bench: GPU present: a test\n", HEADER]
    for batch, bits, attend, topk in rows:
        lines.append(f"{batch:<9} {bits:<4} {attend:>12.4f} {80.0:>12.1f} {topk:>12.4f} {0.2:>12.4f} {0.15:>12.4f}"
                     f" {100.0:>12.2f} {1000:>11} {0.5:>10.3f}\n")
    return "".join(lines)


def run(out_dir, *args, check=True):
    return subprocess.run([sys.executable, str(SCRIPT), str(out_dir), *args], capture_output=True, text=True,
                          check=check)


def test_means_and_changes_against_the_baseline(tmp_path):
    for rnd, (base, fast) in enumerate([(0.40, 0.36), (0.42, 0.38)], start=1):
        (tmp_path / f"variant_v0_8192_{rnd}.txt").write_text(attend_output([(176, "1m", base, 0.10), (176, "2", 1.0, 0.10)]))
        (tmp_path / f"variant_lean_x_8192_{rnd}.txt").write_text(attend_output([(176, "1m", fast, 0.11)]))
    (tmp_path / "variant_means.txt").write_text("not a round")  # the stage's own summary: not read
    out = run(tmp_path).stdout.splitlines()
    one_bit = out.index("176 x 8192 (1m), ms a layer, mean of rounds, change against v0")
    assert out[one_bit + 1].split()[:5] == ["v0", "2", "rounds", "ms_attend", "0.4100"]
    fast = out[one_bit + 2].split()
    assert fast[:7] == ["lean_x", "2", "rounds", "ms_attend", "0.3700", "(-9.8%)", "ms_topk"]
    assert fast[7:9] == ["0.1100", "(+10.0%)"]
    two_bit = out.index("176 x 8192 (2), ms a layer, mean of rounds, change against v0")
    assert out[two_bit + 1].split()[:5] == ["v0", "2", "rounds", "ms_attend", "1.0000"]
    assert len(out) == two_bit + 2, out  # lean_x measured no 2-bit row


def test_a_missing_round_and_a_missing_baseline_are_said(tmp_path):
    (tmp_path / "variant_a_32768_1.txt").write_text(attend_output([(46, "1m", 0.5, 0.2)]))
    (tmp_path / "variant_a_32768_2.txt").write_text("specache-bench: the run failed\n")
    out = run(tmp_path).stdout.splitlines()
    assert out[0] == "46 x 32768 (1m), ms a layer, mean of rounds (v0 not measured)"
    assert out[1].split()[:5] == ["a", "1", "rounds", "ms_attend", "0.5000"]


def test_no_rows_is_an_error(tmp_path):
    result = run(tmp_path, check=False)
    assert result.returncode == 1
    assert "no variant_NAME_CONTEXT_ROUND.txt rows" in result.stderr


def step_output(rows):
    """specache-bench step's table: rows of (kv, batch, ms_layers, ms_no_fetch, ms_fetch), each with its worker line."""
    lines = ["specache-bench: GPU present: a test\n", "== step: 32 layers, a test ==\n",
             "kv                                   batch     ms_layers  ms_no_fetch     ms_fetch     ratio   MB_per_step"
             "      reused GBps_to_hide  tok_per_s  ms_prefill\n"]
    for kv, batch, layers, no_fetch, fetch in rows:
        lines.append(f"{kv:<36} {batch:<8} {layers:>12.3f} {no_fetch:>12.3f} {fetch:>12.3f} {fetch / no_fetch:>9.3f}"
                     f" {136.07:>13.2f} {0.05:>11.2f} {22.0:>12.1f} {2708:>10} {1006.3:>11.1f}\n")
        lines.append(" " * 37 + "its worker, ms a step: list wait 4.816, buffer wait 0.086, gather 4.898 (~27.8 GB/s)\n")
    return "".join(lines)


def test_step_rounds_are_kept_apart_by_their_replica(tmp_path):
    for rnd, (base, fast) in enumerate([(30.0, 28.0), (32.0, 29.0)], start=1):
        (tmp_path / f"variant_v0_8192_{rnd}.txt").write_text(step_output(
            [("specache-1bit-int8_copy-engine", 176, 8.0, base, base + 2.0), ("specache-1bit_copy-engine", 176, 8.0, 40.0, 50.0)]))
        (tmp_path / f"variant_cache_x_8192_{rnd}.txt").write_text(step_output(
            [("specache-1bit-int8_copy-engine", 176, 8.0, fast, fast + 2.0)]))
    out = run(tmp_path).stdout.splitlines()
    int8 = out.index("176 x 8192 (specache-1bit-int8_copy-engine), ms a step, mean of rounds, change against v0")
    assert out[int8 + 1].split()[:9] == ["v0", "2", "rounds", "ms_layers", "8.0000", "(+0.0%)", "ms_no_fetch", "31.0000",
                                         "(+0.0%)"]
    fast = out[int8 + 2].split()
    assert fast[:4] == ["cache_x", "2", "rounds", "ms_layers"]
    assert fast[6:12] == ["ms_no_fetch", "28.5000", "(-8.1%)", "ms_fetch", "30.5000", "(-7.6%)"]
    fp16 = out.index("176 x 8192 (specache-1bit_copy-engine), ms a step, mean of rounds, change against v0")
    assert out[fp16 + 1].split()[6:8] == ["ms_no_fetch", "40.0000"]
    assert fp16 == int8 + 3 and len(out) == fp16 + 2, out  # cache_x measured no fp16-row step
