"""``benchmarks/ncu_summary.py`` reads Nsight Compute raw pages into a results record."""

import gzip
import json

from dropless.perf.bench import load_module
from dropless.perf.measure import REPO_ROOT

PAGE = """\
[2178] python3.12@127.0.0.1
  gmm_fp8_mosaic_gpu_kernel (132, 1, 1)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    ---------------------------------------------------------------- ----------- ------------
    Metric Name                                                      Metric Unit Metric Value
    ---------------------------------------------------------------- ----------- ------------
    device__attribute_display_name                                                NVIDIA H200
    gpu__time_duration.sum                                                    ms         4.09
    launch__registers_per_thread                                 register/thread          168
    sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active             %        65.19
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio                     1.62
    smsp__average_warps_issue_stalled_drain_per_issue_active.ratio                       0.00
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio             2.31
    smsp__inst_executed.sum                                                 inst 1,283,423,806
    smsp__issue_active.avg.pct_of_peak_sustained_active                        %        44.52
"""


def test_a_raw_page_becomes_a_record_with_the_profiled_gpu(tmp_path):
    ncu_summary = load_module("ncu_summary", REPO_ROOT / "benchmarks")
    page = tmp_path / "ncu-fwd.txt.gz"
    with gzip.open(page, "wt") as f:
        f.write(PAGE)
    assert ncu_summary.main(["--out", str(tmp_path / "out"), "--commit", "a" * 40,
                             f"fwd={page}"]) == 0
    [path] = (tmp_path / "out").glob("kernel_anatomy-*-nvidia-h200.json")
    record = json.loads(path.read_text())
    assert record["device"]["gpu"] == "NVIDIA H200" and record["commit"]["commit"] == "a" * 40
    [row] = record["rows"]
    assert row["kernel"] == "fwd" and row["warp_instructions"] == 1283423806
    assert (row["tensor_pipe_active_pct"], row["issue_active_pct"]) == (65.19, 44.52)
    assert row["registers_per_thread"] == 168 and row["duration_ms_at_ncu_clocks"] == 4.09
    # stall reasons, largest first; zeros dropped
    assert list(row["stalls_per_issue"].items()) == [("long_scoreboard", 2.31), ("barrier", 1.62)]
