"""fp8_weight_slice.slice_verdict: is a custom call's weight operand a slice copied out, or read in place?

Checked on the H200's optimized HLO of two proxy steps (``benchmarks/results/logs``,
read in ``benchmarks/notes/fp8_hlo.md``, Q2), where the answer is known: the FP8
step copies each layer's expert weights (``wrapped_slice``) before the Triton weight
quantizer, and the bf16 step's Mosaic GEMMs read theirs inside dynamic-slice fusions.
"""

import gzip
from pathlib import Path

import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]
LOGS = REPO / "benchmarks" / "results" / "logs"


@pytest.fixture(scope="module")
def probe():
    return load_module("fp8_weight_slice", REPO / "benchmarks")


def _read(name):
    with gzip.open(LOGS / name, "rt") as f:
        return f.read()


def test_fp8_step_copies_the_slices_for_the_triton_weight_quantizer(probe):
    """6 weight quantizations (gate|up and down, 3 MoE layers), each fed by a
    ``wrapped_slice`` loop fusion; the activation quantizers' operands are neither."""
    got = probe.slice_verdict(_read("hlo-step-fp8-unrolled-20261202-1323-h200.txt.gz"),
                              "__gpu$xla.gpu.triton")
    copied = [e for v, e in got if v == "copied"]
    assert len(copied) == 6 and all("wrapped_slice" in e and "(root slice)" in e for e in copied)
    assert {v for v, _ in got} == {"copied", "unknown"}


def test_bf16_step_reads_the_slices_in_place_for_the_mosaic_gemms(probe):
    """The fwd and dgrad GEMMs of 3 layers x 2 weights x 2 sit in dynamic-slice fusions."""
    got = probe.slice_verdict(_read("hlo-step-unrolled-20261202-h200.txt.gz"), "mosaic_gpu_v2")
    in_place = [e for v, e in got if v == "in place"]
    assert len(in_place) == 12 and all("dynamic-slice fusion" in e for e in in_place)


def test_small_cases(probe):
    """A parameter read through a bitcast is in place; a copy is copied; another
    target's calls are not reported."""
    hlo = "\n".join([
        "ENTRY %main (w: bf16[2,128,128]) -> f32[] {",
        "  %w = bf16[2,128,128]{2,1,0} parameter(0)",
        "  %b = bf16[2,128,128]{2,1,0} bitcast(%w)",
        '  %q1 = (f8e4m3fn[2,128,128]{2,1,0}, f32[2,1,1]{2,1,0}) custom-call(%b), '
        'custom_call_target="mosaic_gpu_v2"',
        "  %c = bf16[2,128,128]{2,1,0} copy(%w)",
        '  %q2 = (f8e4m3fn[2,128,128]{2,1,0}, f32[2,1,1]{2,1,0}) custom-call(%c), '
        'custom_call_target="mosaic_gpu_v2"',
        '  ROOT %q3 = f32[] custom-call(%w), custom_call_target="other"',
        "}",
    ])
    got = probe.slice_verdict(hlo, "mosaic_gpu_v2")
    assert [v for v, _ in got] == ["in place", "copied"]
    assert got[1][1] == "c = bf16[2,128,128]{2,1,0} copy feeds q2"
