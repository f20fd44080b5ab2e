"""The error model of Hopper's FP8 tensor-core accumulation, and the checks built on it.

Legend: M rows, C contraction, O output columns, G groups.

What the FP8 kernels compute. Each output element is a sum over scale
blocks j of 128 contraction indices::

    y = sum_j  s_j * S_j,   S_j = sum_{i in block j} qa_i * qb_i

with E4M3 codes qa, qb and s_j the product of the two power-of-two block
scales. Every product qa_i * qb_i is exact (4 significant bits each). The
block sum S_j is formed by the tensor cores (``wgmma``), which do not keep
float32 precision for FP8 inputs: they keep about 14 significant bits of
the running sum (DeepSeek-V3 technical report, section 3.3.2, measured on
H800; the same SM90 tensor cores as the H200). The kernel then "promotes"
each block: ``total += s_j * S_j`` in float32 registers.

The model, per block with n = 128 products and 4 wgmma instructions
(k = 32 each) into one accumulator:

* at most n_add = n + 4 additions each lose at most one unit in the 14th
  significant bit of their result, 2^-13 of a magnitude that is at most
  ``P_j = sum_i |qa_i qb_i|`` (no partial sum and no product exceeds it);
* the promotion's multiply is exact (power-of-two scale) and its float32
  add loses at most 2^-24 of the running total, itself at most
  ``sum_j s_j P_j``.

Two checks follow, both against the float64 product of the dequantized
operands (``exact``):

1. worst case, elementwise, for any data::

       |y - exact| <= (n_add 2^-13 + Cb 2^-24) * (|a^| . |b^|)

   since ``sum_j s_j P_j = |a^| . |b^|`` (Cb = number of blocks). Loose
   (about 1.6% of |a^|.|b^|) but unconditional.

2. typical, in Frobenius norm, for random data: each addition's error is
   modelled as independent, zero mean (the signs of products and partial
   sums are random), with |e| <= 2^-13 max(|partial sum|, |product|), hence
   E[e^2] <= 2^-26 (S_i^2 + p_i^2) / 3. With independent zero-mean products
   E[S_i^2] <= Q_j = sum_i p_i^2, so E[err_j^2] <= n_add 2^-26 2 Q_j / 3,
   and over the blocks (independent, scaled by s_j)::

       E[(y - exact)^2] <= (2 n_add / 3) 2^-26 (a^^2 . b^^2)

   because ``sum_j s_j^2 Q_j = (a^ * a^) . (b^ * b^)``. The check asks
   ``||y - exact||_F^2 <= 4 * sum E[...]`` (twice the norm): over the
   >= 10^5 elements of a test the sum of squares concentrates within a few
   percent of its mean, so the factor 4 is room for the model's
   independence assumption, not for noise. For Gaussian data this bound is
   about 1.2e-3 of ||exact||; a kernel that skipped the promotion and
   accumulated a whole K = 7168 row in the tensor cores would be off by
   about 2% (DeepSeek-V3, same section), and one wrong or missing block by
   far more.

Check 2 is the tight one; check 1 catches a single wild element that the
norm would hide.
"""

import numpy as np

N_BLOCK = 128
N_ADD = N_BLOCK + 4  # 128 products + 4 wgmma accumulator hand-overs per block
ULP14 = 2.0**-13  # one unit in the 14th significant bit, relative
F32_ULP = 2.0**-24


def worst_case_bound(abs_product, n_blocks, n_add=N_ADD):
    """Elementwise bound on |y - exact| (check 1); ``abs_product`` = |a^| . |b^|."""
    return (n_add * ULP14 + n_blocks * F32_ULP) * abs_product


def mean_square_bound(sq_product, n_add=N_ADD):
    """Elementwise bound on E[(y - exact)^2] (check 2); ``sq_product`` = a^^2 . b^^2."""
    return (2.0 * n_add / 3.0) * ULP14**2 * sq_product


def check(got, exact, abs_product, sq_product, n_blocks, what="", n_add=N_ADD, out_roundoff=0.0):
    """Assert both checks; returns ``(rel_frobenius_error, rel_frobenius_bound)``.

    Arguments are float64 arrays of the output's shape: the kernel's result,
    the exact product of the dequantized operands, ``|a^| . |b^|`` and
    ``a^^2 . b^^2`` (each the same grouped product as ``exact``). ``n_add``: the
    tensor-core additions between promotions (a whole contraction of n terms where
    the promotion interval is unknown: n + n/32). ``out_roundoff``: the unit roundoff
    of a rounding of the result after the sum (2^-8 for bfloat16), relative to the
    result; it adds ``out_roundoff |y|`` to check 1 and ``out_roundoff ||y||`` to
    check 2's norm.
    """
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    err = np.abs(got - exact)
    bound = out_roundoff * np.abs(got) + worst_case_bound(abs_product, n_blocks, n_add)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
    assert np.all(err <= bound), (
        f"{what}: |y - exact| = {err[worst]:.3e} > worst-case bound {bound[worst]:.3e} at {worst}")
    norm = np.linalg.norm(exact) or 1.0
    rel_err = np.linalg.norm(err) / norm
    rel_bound = (out_roundoff * np.linalg.norm(got)
                 + np.sqrt(4.0 * mean_square_bound(sq_product, n_add).sum())) / norm
    assert rel_err <= rel_bound, (
        f"{what}: relative Frobenius error {rel_err:.3e} > accumulation-model bound {rel_bound:.3e}")
    return rel_err, rel_bound


# ------------------------------------------------------------------ grouped products in float64


def gmm(a_MC, b_GCO, sizes):
    """Rows of group g of a times b[g]; rows past the total are 0."""
    out, start = np.zeros((a_MC.shape[0], b_GCO.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = a_MC[start:start + n] @ b_GCO[g]
        start += n
    return out


def tgmm(a_MK, b_MN, sizes):
    """dw[g] = a[rows of g]^T . b[rows of g]; zeros for empty groups."""
    out, start = np.zeros((len(sizes), a_MK.shape[1], b_MN.shape[1])), 0
    for g, n in enumerate(sizes):
        out[g] = a_MK[start:start + n].T @ b_MN[start:start + n]
        start += n
    return out


def check_product(fn, got, a, b, sizes, n_blocks, what=""):
    """``check`` for ``fn(a, b, sizes)`` (``gmm`` or ``tgmm``) of dequantized float64 operands."""
    exact = fn(a, b, sizes)
    return check(got, exact, fn(np.abs(a), np.abs(b), sizes), fn(a * a, b * b, sizes),
                 n_blocks, what)
