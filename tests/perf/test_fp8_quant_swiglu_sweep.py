"""fp8_quant.py --swiglu-variants --smoke: the sweep's CPU check runs the one-pass SwiGLU
quantizers (Pallas GPU interpret mode) at each tile walk and pipeline depth of
``SWIGLU_DEPTHS`` (whole and half tiles) and checks each against XLA's SwiGLU then the Mosaic pass of its
layout, bit for bit."""

import json
from pathlib import Path

import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]

# A benchmark's sweep of opt-in variants: run before a device call that runs it.
pytestmark = pytest.mark.slow(reason="a benchmark sweep's CPU check, left out for CI time")


def test_swiglu_sweep_smoke_checks_every_depth_against_the_two_pass_reference(tmp_path):
    fq = load_module("fp8_quant", REPO / "benchmarks")
    assert fq.main(["--swiglu-variants", "--smoke", "--iters", "1", "--out", str(tmp_path)]) == 0
    [record] = [json.loads(p.read_text()) for p in tmp_path.glob("fp8_quant_swiglu-*.json")]
    for layout in ("rows", "columns"):
        fused = [r for r in record["rows"] if r["name"].startswith(f"swiglu_{layout} ")]
        assert [r["name"] for r in fused] == (
            [f"swiglu_{layout} t{t} s{s} o{o}" for t, s, o in fq.SWIGLU_DEPTHS]
            + [f"swiglu_{layout} half t{t} s{s} o{o}" for t, s, o in fq.SWIGLU_HALF_DEPTHS])
        assert all(r["equal"] and r["bitwise_equal_to"] == f"swiglu then {layout}" for r in fused)


def test_swiglu_sweep_refuses_gate_up_widths_that_do_not_split_into_blocks(capsys):
    fq = load_module("fp8_quant", REPO / "benchmarks")
    assert fq.main(["--swiglu-variants", "--swiglu-shapes", "256x384"]) == 2
    assert "multiple of 256" in capsys.readouterr().err
