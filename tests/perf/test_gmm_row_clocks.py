"""benchmarks/gmm.py: each row carries the GPU clocks over its own timings.

``bench_shape`` with the ``dense`` impl on a tiny shape (the same jitted products as
on the GPU; off it the timings fall back to wall clock) and a sampler driven by a
fake NVML reader (``fake_nvml``, tests/conftest.py): every layout's row gets its own window's summary, and without
NVML the rows say why.
"""

import argparse
from pathlib import Path

from dropless.perf import clocks
from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]
gmm = load_module("gmm", REPO / "benchmarks")


def _rows(sampler):
    record = {"results": []}
    args = argparse.Namespace(quant="none", iters=2)
    with sampler:
        gmm.bench_shape(256, 4, 128, 128, ["balanced", "dirichlet0.3"], ["dense"], None, args,
                        record, clocks=sampler)
    return record["results"]


def test_each_row_has_its_own_windows_clocks(capsys, fake_nvml):
    reader = fake_nvml(sm_mhz=2000.0, step=-100.0, power_w=500.0, reasons=0)
    rows = _rows(clocks.ClockSampler(interval_s=3600.0, open_reader=lambda i: reader))
    assert [r["layout"] for r in rows] == ["balanced", "dirichlet0.3"]
    assert all(r["tflops"]["dense"]["fwd"] > 0 for r in rows)
    # Entry and exit readings only (the interval is an hour): 1900/1800, then 1700/1600.
    assert [r["gpu_clocks"]["sm_mhz_median"] for r in rows] == [1850.0, 1650.0]
    assert [r["gpu_clocks"]["n_samples"] for r in rows] == [2, 2]
    assert "GPU over the row's timings: SM clock median 1,850 MHz" in capsys.readouterr().out


def test_without_nvml_the_rows_say_why():
    def no_nvml(index):
        raise clocks.ClocksUnavailable("nvmlInit failed: no driver")

    rows = _rows(clocks.ClockSampler(open_reader=no_nvml))
    assert all(r["gpu_clocks"] == {"available": False, "reason": "nvmlInit failed: no driver"}
               for r in rows)
