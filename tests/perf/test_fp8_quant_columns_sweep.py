"""fp8_quant.py --columns-variants --smoke: the sweep's CPU check runs the Mosaic GPU
rows, columns and fused kernels (in Pallas GPU interpret mode) at each tile walk and
pipeline depth of ``COLUMNS_DEPTHS`` and checks each against the Triton kernels of
its layout, bit for bit."""

import json
from pathlib import Path

import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]

# A benchmark's sweep of opt-in variants: run before a device call that runs it.
pytestmark = pytest.mark.slow(reason="a benchmark sweep's CPU check, left out for CI time")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(the benchmark module, the smoke sweep's record)."""
    out = tmp_path_factory.mktemp("fp8_quant")
    fq = load_module("fp8_quant", REPO / "benchmarks")
    assert fq.main(["--columns-variants", "--smoke", "--iters", "1", "--out", str(out)]) == 0
    [record] = [json.loads(p.read_text()) for p in out.glob("fp8_quant_columns-*.json")]
    return fq, record


@pytest.mark.parametrize(("kernel", "reference"), [("rows", "rows"), ("columns", "columns w4"),
                                                   ("rows_and_columns", "rows + columns")])
def test_sweep_smoke_times_the_mosaic_kernels(sweep, kernel, reference):
    fq, record = sweep
    mosaic = [r for r in record["rows"] if r["name"].startswith(f"{kernel} mosaic")]
    assert [r["name"] for r in mosaic] == [f"{kernel} mosaic t{t} s{s} o{o}"
                                           for t, s, o in fq.COLUMNS_DEPTHS]
    assert all(r["equal"] and r["bitwise_equal_to"] == reference for r in mosaic)
