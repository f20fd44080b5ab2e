"""fp8_quant.py --columns-variants --smoke: the sweep's CPU check runs the Mosaic GPU
columns kernel (in Pallas GPU interpret mode) at each tile walk and pipeline depth of
``COLUMNS_DEPTHS`` and checks each against the Triton columns kernel, bit for bit."""

import json
from pathlib import Path

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]


def test_columns_sweep_smoke_times_the_mosaic_kernel(tmp_path):
    fq = load_module("fp8_quant", REPO / "benchmarks")
    assert fq.main(["--columns-variants", "--smoke", "--iters", "1", "--out", str(tmp_path)]) == 0
    [record] = [json.loads(p.read_text()) for p in tmp_path.glob("fp8_quant_columns-*.json")]
    mosaic = [r for r in record["rows"] if r["name"].startswith("columns mosaic")]
    assert [r["name"] for r in mosaic] == [f"columns mosaic t{t} s{s} o{o}"
                                           for t, s, o in fq.COLUMNS_DEPTHS]
    assert all(r["equal"] and r["bitwise_equal_to"] == "columns w4" for r in mosaic)
