"""The FP8 accumulation-model checks (``fp8_accumulation``) used by the GPU kernel tests.

A check that cannot fail proves nothing, and one that is tighter than the
arithmetic it claims to model fails correct kernels. So, on CPU, the checks
are run against simulated accumulators on random E4M3 codes with
power-of-two block scales (C = 7168, DeepSeek-V3's contraction):

- a simulated tensor core that truncates its running sum to 14 significant
  bits after every addition (toward zero, the harsher of the two roundings)
  and promotes each 128-block to float64: both checks pass;
- the same accumulator never promoted (the whole row summed at 14 bits,
  the failure DeepSeek-V3 measured at about 2%): check 2 fails;
- the exact product with one scale block left out: fails.
"""

import fp8_accumulation as acc
import ml_dtypes
import numpy as np
import pytest

M, O, C = 48, 64, 7168
NB = C // acc.N_BLOCK


def _trunc14(v):
    m, e = np.frexp(v)
    return np.ldexp(np.trunc(m * 2.0**14) / 2.0**14, e)


def _operands(rng):
    """Dequantized float64 operands a [M, C], b [C, O] from E4M3 codes and 2^k block scales."""
    qa = rng.standard_normal((M, C)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 40
    qb = rng.standard_normal((C, O)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 40
    qa = qa.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    qb = qb.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sa = np.ldexp(1.0, rng.integers(-8, -4, (M, NB)))
    sb = np.ldexp(1.0, rng.integers(-8, -4, (NB, O)))
    return qa, qb, sa, sb


def _simulate(qa, qb, sa, sb, promote):
    """Sequential 14-bit accumulation; promoted to float64 every block if ``promote``."""
    total = np.zeros((M, O))
    run = np.zeros((M, O))
    for j in range(NB):
        for i in range(j * 128, (j + 1) * 128):
            scale = sa[:, j:j + 1] * sb[j:j + 1, :]
            term = np.outer(qa[:, i], qb[i]) * (1.0 if promote else scale)
            run = _trunc14(run + term)
        if promote:
            total += run * sa[:, j:j + 1] * sb[j:j + 1, :]
            run = np.zeros((M, O))
    return total if promote else run


def _dequantized(qa, qb, sa, sb):
    return qa * np.repeat(sa, 128, axis=1), qb * np.repeat(sb, 128, axis=0)


def _check(got, a, b):
    return acc.check(got, a @ b, np.abs(a) @ np.abs(b), (a * a) @ (b * b), NB)


@pytest.fixture
def operands(rng):
    return _operands(rng)


def test_model_accumulator_passes(operands):
    a, b = _dequantized(*operands)
    rel_err, rel_bound = _check(_simulate(*operands, promote=True), a, b)
    print(f"{rel_err=:.2e} {rel_bound=:.2e}")
    assert 0 < rel_err < rel_bound < 5e-3  # far below the ~2% of an unpromoted sum


def test_unpromoted_accumulation_fails_the_norm_check(operands):
    a, b = _dequantized(*operands)
    got, exact = _simulate(*operands, promote=False), a @ b
    rel_err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    rel_bound = np.sqrt(4 * acc.mean_square_bound((a * a) @ (b * b)).sum()) / np.linalg.norm(exact)
    assert rel_err > 2 * rel_bound
    with pytest.raises(AssertionError):
        _check(got, a, b)


def test_missing_block_fails(rng, operands):
    a, b = _dequantized(*operands)
    j = rng.integers(NB)
    cut = a.copy()
    cut[:, j * 128:(j + 1) * 128] = 0
    with pytest.raises(AssertionError):
        _check(cut @ b, a, b)
