"""``benchmarks/step.py``'s same-run ratios (``speedups``)."""

from pathlib import Path

import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def step():
    return load_module("step", REPO / "benchmarks")


def rows(**tflops):
    return [{"case": c, "tflops_per_device": t} for c, t in tflops.items()]


def test_speedups_against_the_baselines_ours_and_the_fp8_defaults(step):
    got = step.speedups(rows(xla=50.0, capacity=250.0, ours=500.0, ours_fp8_blockwise=550.0,
                             ours_fp8_halves=561.0))
    assert got == pytest.approx({
        "ours_over_xla": 10.0, "ours_over_capacity": 2.0, "ours_over_best_baseline": 2.0,
        "ours_fp8_blockwise_over_ours": 1.1, "ours_fp8_halves_over_ours": 1.122,
        "ours_fp8_halves_over_ours_fp8_blockwise": 1.02})


def test_speedups_of_fp8_variants_without_ours_and_with_a_failed_case(step):
    # Only the FP8 pair ran (the next GPU run's command): their ratio still comes out;
    # a case that failed (no TFLOP/s) gives none.
    assert step.speedups(rows(ours_fp8_blockwise=550.0, ours_fp8_halves=577.5)) == pytest.approx(
        {"ours_fp8_halves_over_ours_fp8_blockwise": 1.05})
    assert step.speedups(rows(ours_fp8_blockwise=550.0, ours_fp8_halves=None)) == {}
    assert "ours_fp8_halves" in step.EXTRA_CASES
    assert "gmm_fp8_kernel_schedule=halves_unfenced" in step.CASE_OVERRIDES["ours_fp8_halves"]


def test_every_case_can_be_asked_for_and_has_its_overrides(step):
    """``--cases`` accepts exactly the cases with overrides (a case missing from the lists
    is refused by the command line before anything runs)."""
    assert set(step.CASE_OVERRIDES) == set(step.CASES + step.EXTRA_CASES)
    assert len(step.CASES + step.EXTRA_CASES) == len(set(step.CASES + step.EXTRA_CASES))


def test_speedups_under_the_earlier_minimal_policy(step):
    got = step.speedups(rows(ours=520.0, ours_minimal=500.0, ours_fp8_blockwise=598.0,
                             ours_fp8_minimal=550.0))
    assert got["ours_minimal_over_ours"] == pytest.approx(500.0 / 520.0)
    assert got["ours_fp8_minimal_over_ours_minimal"] == pytest.approx(1.1)
    assert got["ours_fp8_minimal_over_ours_fp8_blockwise"] == pytest.approx(550.0 / 598.0)
