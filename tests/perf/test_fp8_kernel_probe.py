"""benchmarks/fp8_kernel_probe.py: ``--sustain``'s back-to-back run and the clocks in each row.

The kernels need a Hopper GPU (their timings run there); here a jitted stand-in
takes their place, so what is checked is the probe's bookkeeping: ``heat`` keeps
the device busy for the time asked and not at all for 0, and ``time_job`` writes
the row's timings and the clocks of its window (unavailable on a CPU host), twice
with ``--sustain`` (before and after the back-to-back run).
"""

import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dropless.perf.bench import load_module
from dropless.perf.clocks import ClockSampler

REPO = Path(__file__).parents[2]
probe = load_module("fp8_kernel_probe", REPO / "benchmarks")


def _counting(fn):
    calls = []

    def f(args):
        calls.append(1)
        return fn(args)

    return f, calls


def test_heat_runs_the_kernel_for_the_time_asked_and_not_at_all_for_zero():
    f, calls = _counting(jax.jit(lambda a: a * 2.0))
    x = jnp.ones((8,))
    probe.heat(f, x, 0.0)
    assert calls == []
    t0 = time.monotonic()
    probe.heat(f, x, 0.2)
    assert time.monotonic() - t0 >= 0.2
    assert len(calls) >= 8 and len(calls) % 8 == 0  # whole batches of queued calls


def test_time_job_writes_the_timings_and_the_windows_clocks(monkeypatch):
    # A stand-in for the fwd kernel: same call signature as gmm_fp8_blockwise.
    monkeypatch.setattr(probe.mosaic_fp8, "gmm_fp8_blockwise",
                        lambda *o, **kw: o[0].astype(jnp.float32) * 2.0)
    monkeypatch.setattr(probe, "cupti_ms", lambda f, args, iters: 2.0)
    ops = {"fwd": (jnp.ones((4, 4)),)}
    record = {"rows": []}
    unavailable = lambda _index: (_ for _ in ()).throw(RuntimeError("no NVML here"))  # noqa: E731
    with ClockSampler(open_reader=unavailable) as clocks:
        probe.time_job("rows_gtw8", "fwd", ops, None, 4e9, 2, clocks, record, sustain=0.05)
    cold, hot = record["rows"]  # with --sustain: the short-run timing, then the sustained one
    assert [cold["sustained"], hot["sustained"]] == [False, True]
    for row in (cold, hot):
        assert row["variant"] == "rows_gtw8" and row["product"] == "fwd"
        assert row["kernel_ms"] == 2.0 and row["tflops_kernel"] == 4e9 / 2.0 / 1e9
        assert row["wall_ms"] > 0
        assert row["gpu_clocks"] == {"available": False, "reason": "RuntimeError: no NVML here"}
    record = {"rows": []}
    with ClockSampler(open_reader=unavailable) as clocks:
        probe.time_job("rows_gtw8", "fwd", ops, None, 4e9, 2, clocks, record)
    (row,) = record["rows"]  # without: one timing, no "sustained" key (earlier records' layout)
    assert "sustained" not in row and row["kernel_ms"] == 2.0


def test_a_run_cut_after_its_first_job_leaves_a_record_of_that_row(monkeypatch, tmp_path):
    # The kernels and their operands are stood in for: what is checked is that the record
    # is on disk after each job, marked incomplete, before the run ends.
    import json

    monkeypatch.setattr(probe, "operands", lambda m, g, k, n, sizes: ({}, None))
    calls = []

    def job(v, prod, ops, gs, flops, iters, clocks, record, sustain=0.0):
        if calls:
            raise KeyboardInterrupt  # the time limit's kill, after the first job
        calls.append((v, prod))
        record["rows"].append({"variant": v, "product": prod, "tflops_kernel": 1.0})

    monkeypatch.setattr(probe, "time_job", job)
    try:
        probe.main(["--shape", "1024,8,256,256", "--variants", "rows_gtw8",
                    "--wgrad-variants", "", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        pass
    (path,) = tmp_path.glob("fp8_kernels-*.json")
    record = json.loads(path.read_text())
    assert record["complete"] is False
    assert record["rows"] == [{"variant": "rows_gtw8", "product": "fwd", "tflops_kernel": 1.0}]
