"""tools/bench/variant_means.py on hand-made `specache-bench attend` outputs: each variant's mean
over its rounds, its change against the baseline, rows of other bit widths kept apart, a round a
variant lacks counted, and no rows at all an error."""

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
