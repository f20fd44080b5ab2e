"""Quantized grouped GEMMs (``te_gmm_quantization``): FP8 numerics over our bf16 kernels.

Legend: M rows (token copies sorted by group), K contraction, N output
features, G groups; as in ``api``.

``gmm(x, w, group_sizes, recipe=...)`` computes the forward product and,
through its custom VJP, dgrad and wgrad, each on operands quantized for that
product, with the scale blocks running along the product's contraction:

  product                  contraction   te_mxfp8 (E4M3, E8M0 / 32)   te_fp8_blockwise (E4M3)
  fwd   y  = x . w[g]        K           x along K, w along K         x 1x128, w 128x128
  dgrad dx = dy . w[g]^T     N           dy along N, w along N        dy 1x128, w 128x128
  wgrad dw = x^T . dy        M (ragged)  x along M, dy along M        x 128x1, dy 128x1

(so x, w and dy are each quantized twice, as Transformer Engine's row- and
column-wise copies; blockwise weights need one copy, 128x128 blocks serve
both w and w^T). Gradients are E4M3 too: with one scale per 32 or 128
elements the range E5M2 would add is not needed (DeepSeek-V3 and TE's
MXFP8 recipe do the same).

Group alignment. The wgrad blocks run along M, the ragged dimension: a block
must not hold rows of two groups. With ``groups_aligned=True`` the caller
promises that every group size is a multiple of ``required_alignment(recipe)``
(32 for MXFP8, 128 for blockwise); the MoE block gets this from the
permutation's ``alignment`` option (padding rows are zeros). Otherwise (the
default) the wgrad product first regroups x and dy so that each group starts
on a block boundary (``align_groups``: a row gather, zero rows between
groups, fused by XLA with the quantization that reads them), so any group
sizes get the recipe's numerics. Group sizes are traced values: a promise
that does not hold cannot be detected under ``jit``.

How it runs (``impl``). ``auto`` (the default) is ``kernel`` for
``te_fp8_blockwise`` where the kernels run (the bf16 backend resolves to
``mosaic``, i.e. a Hopper GPU, and K and N are multiples of 256) and
``emulate`` everywhere else; ``resolve_impl`` decides, and a log line says
once per process which path runs and, when ``auto`` emulates on a GPU, why.

``emulate`` (both recipes): quantize ->
dequantize to the compute dtype -> the bf16 grouped GEMM of the chosen
backend. This is exact, not an approximation: an E4M3 value times a power
of two (every scale of both recipes is one) is representable in bfloat16
whenever the result is a normal number, so the bf16 tensor-core products
with float32 accumulation are the FP8 products a native MXFP8 (Blackwell)
or FP8-blockwise kernel would form, and only the accumulation order differs
(tests/ops/test_gmm_quantized.py checks this against float64). The
quantize-dequantize is elementwise plus small block reductions; XLA fuses
it with whatever produces the operand, so it is not a separate kernel, but
it adds a pass over each operand that an FP8 kernel reading codes and
scales would not, and the GEMM runs at bf16, not FP8, speed. A log line
says so once per process. Hopper has no MXFP8 tensor-core mode, so
``te_mxfp8`` is always emulated.

``kernel`` (``te_fp8_blockwise`` only): the three products run in
the FP8 Mosaic GPU kernels of ``mosaic_fp8`` (fwd, dgrad) and
``mosaic_fp8_tgmm`` (wgrad) on E4M3 codes and float32 scales, each operand
quantized (``quant_impl``: ``pallas``, the single-pass kernels of
``fp8_quant_kernels``; ``mosaic``, their Mosaic GPU versions in
``fp8_quant_mgpu`` (bf16 operands); or ``xla``, ``ops.quant`` fused by XLA; the same
codes and scales bit for bit but for the codes of a NaN-scale block, whose
dequantized values are NaN either way; ``auto`` is ``pallas`` with the
weights of bfloat16 by ``fp8_quant_mgpu``; ``quantizer`` decides) in the layout its
kernel reads:

  fwd    x 1x128 [M, K] + scales [Kb, M];  w 128x128, codes as [G, N, K]
  dgrad  dy 1x128 [M, N] + scales [Nb, M]; w 128x128, codes as [G, K, N]
  wgrad  x, dy 128x1, codes transposed to [K, M] and [N, M]

(the weight is quantized once, in the forward, into both byte layouts,
because FP8 wgmma reads both operands K-major; dgrad reuses the forward's
codes, kept as the backward's residual at one byte per weight; with
``groups_aligned`` dgrad and wgrad read the same dy rows, so dy is quantized
into both of its layouts by one call, ``Quantizer.rows_and_columns``, and so is x,
in the forward: its 128x1 codes, not x, are the backward's residual). The
numerics are the emulation's up to float32 accumulation order and Hopper's
FP8 accumulation (tested on an H200): the same codes, the same scales.
Measured on an H200 (``benchmarks/notes/fp8.md``): fwd+dgrad+wgrad at
M=65536 G=32 K=7168 N=4096 with the Pallas quantizers takes 15.3 ms of
kernel time against 16.2 ms for the bf16 kernels (1.06x; 18.1 ms with
XLA's quantization passes), and the DeepSeek-V3 proxy's training step runs
at 1.06x bf16 with FP8 dense layers and these kernels, against 0.92x for
the emulation; hence ``auto``.
They need a Hopper GPU, or Pallas GPU interpret mode (tests), K and N
multiples of 256, and ignore ``backend``.
"""

import functools
import importlib
import logging
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dropless.ops import quant
from dropless.ops.gmm import api

RECIPES = ("te_no_quant", "te_fp8_blockwise", "te_mxfp8")
IMPLS = ("auto", "emulate", "kernel")  # how te_fp8_blockwise runs (module docstring)
KERNEL_RECIPE = "te_fp8_blockwise"
PROLOGUES = (None, "swiglu")  # what ``gmm(prologue=...)`` computes x from (its docstring)
# How impl="kernel" quantizes its operands: "xla", ``ops.quant`` fused by XLA;
# "pallas", the single-pass kernels of ``fp8_quant_kernels`` (Pallas on Triton);
# "mosaic", every operand by the kernels of ``fp8_quant_mgpu`` (Mosaic GPU,
# bf16 only; typed-FFI calls, whose operand XLA can slice out of the stacked
# layers in place); "auto", ``fp8_quant_mgpu`` for each bf16 operand and the
# Triton kernels for other dtypes (measured, ``quantizer``). All give the same
# codes and scales bit for bit (but for a NaN-scale block's codes on the GPU).
QUANT_IMPLS = ("auto", "xla", "pallas", "mosaic")
# How the three FP8 kernels schedule their 128-wide steps (config key
# ``gmm_fp8_kernel_schedule``): name -> (keyword arguments of the forward and dgrad
# kernel, ``mosaic_fp8.gmm_fp8_blockwise``; of the wgrad kernel,
# ``mosaic_fp8_tgmm.tgmm_fp8_blockwise``). Every schedule gives the same bits.
#   default          ``wide_o192_n160``, below: the same bits, its kernels 1.07-1.09x
#                    ``narrow``'s in one process, the proxy's training step 1.013x and
#                    1.014x (``step-20261205-152704``; ``step-20261206-035133``, 1.127x
#                    bf16 in the same process).
#   narrow           the kernels' own defaults, 128x128 CTA tiles (forward and dgrad:
#                    the plain step with the scale reads fenced; wgrad: each step's
#                    promotion during the next step's wgmma); the default until
#                    2026-12-06, and the schedule the ratios below are against.
#   halves_unfenced  each step as two wgmmas over 64-column halves, the first half's
#                    promotion running under the second half's wgmma (``parts=2``), and
#                    the forward's and dgrad's scale reads without the proxy fence, as
#                    DeepGEMM's SM90 kernels (``scale_fence="none"``); the wgrad's plain
#                    step in halves. On an H200 (M=65536, G=32, balanced, CUPTI, same
#                    process): fwd 1,274 / dgrad 1,234 TF/s against 1,229 / 1,200 at
#                    K=7168 N=4096, and after 8 s under the power cap 1,142 / 1,085 against
#                    1,054 / 1,050; at K=2048 N=7168 1,120 / 1,247 against 1,096 / 1,200;
#                    wgrad (bf16 out) 910 against 874, 898 against 891
#                    (``fp8_kernels-parts-sustain-k7168-n4096-20261204-211715``,
#                    ``fp8_kernels-parts-k2048-n7168-20261204-212131``). Opt-in until the
#                    step confirms it (``benchmarks/step.py --cases ours_fp8_blockwise,
#                    ours_fp8_halves``).
#   p96_32_unfenced  as ``halves_unfenced`` with a 96- and a 32-column wgmma per step
#                    (``parts=(96, 32)``, in all three kernels): the long slice's
#                    promotion under the short slice's wgmma, 16 multiply-adds per thread
#                    after the last wait instead of 32. Step: 0.998x the default.
#   xhalves_unfenced the forward's and dgrad's halves across steps (``overlap=True,
#                    parts=2``: each promotion under the next wgmma, the previous step's
#                    second half under this step's first), unfenced; the wgrad as
#                    ``halves_unfenced``. Step: 0.967x the default.
# In the proxy's training step (one H200, power-capped throughout) none pays: halves
# 1.004x, (96, 32) 0.998x, across steps 0.967x over ``default``, each in one process
# (``step-fp8-schedules-20261205-015359``, ``step-fp8-xhalves-20261205-015824``);
# every schedule gave the default's bits on the hardware. (``default`` in these ratios
# is today's ``narrow``.)
#   wide_o192        the forward and dgrad with 64x192 warpgroup tiles (``block_o=192``:
#                    128x192 CTA tiles, DeepGEMM's widest for 128x128 weight scales);
#                    the wgrad as ``narrow``.
#   wide_n160        the wgrad's plain step with 128x160 CTA tiles (``block_n=160``;
#                    DeepGEMM's SM90 wgrad uses 128x152); the forward and dgrad as
#                    ``narrow``.
#   wide_n192        the same with 128x192 wgrad tiles (they spill: about 560 TF/s).
#   wide_o192_n160   ``wide_o192``'s forward and dgrad with ``wide_n160``'s wgrad: on an
#                    H200 at K=2048 N=7168, fwd 1,191 / dgrad 1,281 TF/s against 1,090 /
#                    1,201 and wgrad 892 against 834 (``fp8_kernels-20261205-152047``);
#                    fwd+dgrad+wgrad with its quantization at K=7168 N=4096, 1.25x our
#                    bf16 kernels against 1.22x (``fp8_quant-20261205-152503``).
#   wide_o192_n192   ``wide_o192``'s forward and dgrad with ``wide_n192``'s wgrad.
#   wide_o192_n160_under  ``wide_o192_n160`` with each plain step's scale reads and
#                    their fence between its wgmma's issue and its wait, not before the
#                    issue (``mosaic_fp8.SCALE_READS``); the same bits. On an H200 the
#                    forward and dgrad ran even and the wgrad 0.86x
#                    (``fp8_kernels-20261206-215854``): not for training.
_WIDE_O192 = (("block_o", 192),)
_WIDE_N160 = (("overlap", False), ("block_n", 160))
_WIDE_N192 = (("overlap", False), ("block_n", 192))
_UNDER = (("scale_reads", "under"),)
DEFAULT_KERNEL_SCHEDULE = "wide_o192_n160"  # the schedule ``default`` runs, named in the log
_SCHEDULES = {
    "narrow": ((), ()),
    "halves_unfenced": ((("parts", 2), ("scale_fence", "none")),
                        (("overlap", False), ("parts", 2))),
    "p96_32_unfenced": ((("parts", (96, 32)), ("scale_fence", "none")),
                        (("overlap", False), ("parts", (96, 32)))),
    "xhalves_unfenced": ((("overlap", True), ("parts", 2), ("scale_fence", "none")),
                         (("overlap", False), ("parts", 2))),
    "wide_o192": (_WIDE_O192, ()),
    "wide_n160": ((), _WIDE_N160),
    "wide_n192": ((), _WIDE_N192),
    "wide_o192_n160": (_WIDE_O192, _WIDE_N160),
    "wide_o192_n192": (_WIDE_O192, _WIDE_N192),
    "wide_o192_n160_under": (_WIDE_O192 + _UNDER, _WIDE_N160 + _UNDER),
}
KERNEL_SCHEDULES = {"default": _SCHEDULES[DEFAULT_KERNEL_SCHEDULE], **_SCHEDULES}
_KERNEL_DIM = 256  # K and N: the kernels' CTA tiles are 256 wide along O, 128 along C
_ALIGNMENT = {"te_no_quant": 1, "te_fp8_blockwise": quant.BLOCKWISE_TILE, "te_mxfp8": quant.MX_BLOCK}
_log = logging.getLogger(__name__)


def required_alignment(recipe: str) -> int:
    """Group sizes must be multiples of this for ``recipe`` (1, 32 or 128).

    Raises:
      ValueError: unknown recipe.
    """
    if recipe not in RECIPES:
        raise ValueError(f"gmm quantization recipe {recipe!r} is not one of {RECIPES}")
    return _ALIGNMENT[recipe]


def align_groups(a_MC, group_sizes_G, block):
    """Rows regrouped so that every group starts on a multiple of ``block``.

    Args:
      a_MC: [M, C] rows sorted by group (rows past ``sum(group_sizes)`` are ignored).
      group_sizes_G: [G] int32, sum <= M.
      block: the alignment (the recipe's scale block along M).

    Returns:
      (a_PC, padded_G): a_PC [P, C], P = M + G (block - 1) rounded up to a
      multiple of block (static), holding group g's rows at
      ``sum(padded[:g])`` followed by zero rows up to ``padded[g]``, the size
      rounded up to a multiple of block; zero rows after the last group.
    """
    m, g = a_MC.shape[0], group_sizes_G.shape[0]
    p = -(-(m + g * (block - 1)) // block) * block
    sizes = group_sizes_G.astype(jnp.int32)
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    start = jnp.cumsum(sizes) - sizes
    row = jnp.arange(p, dtype=jnp.int32)
    # Unrolled: no while loop in the step (``schedule.row_tile_schedule``).
    group = jnp.searchsorted(padded_end, row, side="right", method="scan_unrolled").astype(jnp.int32)
    inside = group < g
    group = jnp.minimum(group, g - 1)
    offset = row - (padded_end[group] - padded[group])
    valid = inside & (offset < sizes[group])
    src = jnp.where(valid, start[group] + offset, 0)
    return jnp.where(valid[:, None], a_MC[src], jnp.zeros((), a_MC.dtype)), padded


def _wgrad_rows(x, dy, group_sizes, block, aligned):
    """(x, dy, group sizes) for a wgrad whose scale blocks run along M (``align_groups``)."""
    if aligned:
        return x, dy, group_sizes
    x, padded = align_groups(x, group_sizes, block)
    dy, _ = align_groups(dy, group_sizes, block)
    return x, dy, padded


def qdq(a, recipe, axis, out_dtype=None):
    """Quantize-dequantize one operand for a product contracting ``axis``.

    The result is in ``out_dtype`` (default a's dtype); exact in bfloat16.

    2-D activations [M, K] / [M, N]: blocks of 32 (MXFP8) or 128 (blockwise)
    along ``axis``. 3-D weights [G, K, N]: MXFP8 blocks along ``axis``;
    blockwise 128x128 over (K, N) whatever the axis.
    """
    if recipe == "te_mxfp8":
        return quant.qdq_mx(a, axis, out_dtype)
    if recipe == "te_fp8_blockwise":
        tile = quant.BLOCKWISE_TILE
        if a.ndim == 3:
            block = (1, tile, tile)
        else:
            block = tuple(tile if i == axis % a.ndim else 1 for i in range(a.ndim))
        return quant.qdq_blocks(a, block, out_dtype=out_dtype)
    raise ValueError(f"qdq: recipe {recipe!r} does not quantize")


def resolve_impl(impl: str, recipe: str, backend: str, x_shape, w_shape, dtype) -> tuple[str, str]:
    """(``"kernel"`` | ``"emulate"``, why) for ``impl`` (one of ``IMPLS``) at these shapes.

    ``auto`` runs the FP8 kernels for ``te_fp8_blockwise`` when the bf16
    backend resolves to ``mosaic`` (a Hopper GPU; ``gmm_backend=xla`` asks
    for ``lax.ragged_dot`` and gets the emulation over it) and K and N of w
    are multiples of 256; ``why`` names the condition that failed, or "".
    """
    if impl != "auto":
        return impl, ""
    why = _kernel_refusal(recipe, w_shape, api.resolve_backend(backend, x_shape, w_shape, dtype))
    return ("emulate", why) if why else ("kernel", "")


def kernels_run_on_hopper(impl: str, recipe: str, backend: str, w_shape) -> bool:
    """Whether ``impl`` would run the FP8 kernels for w of ``w_shape`` on a Hopper GPU, where
    ``backend`` ``auto`` resolves to ``mosaic``: ``resolve_impl`` for a target that is not
    the host (memory estimates for an H200 made on a CPU)."""
    if impl == "emulate":
        return False
    if impl == "kernel":
        return recipe == KERNEL_RECIPE
    return backend in ("auto", "mosaic") and not _kernel_refusal(recipe, w_shape, "mosaic")


def _kernel_refusal(recipe: str, w_shape, backend: str | None = None) -> str:
    """Why the FP8 kernels cannot run ``recipe`` on w of ``w_shape`` here, or "" when they can.

    ``backend``: for ``impl="auto"``, the resolved bf16 backend (the kernels run
    only where it is ``mosaic``); None for ``impl="kernel"``, which ignores the
    backend and needs a Hopper GPU or Pallas GPU interpret mode.
    """
    if recipe != KERNEL_RECIPE:
        return f"the FP8 kernels exist for recipe {KERNEL_RECIPE!r} only, got {recipe!r}"
    if backend is None:
        from dropless.ops.gmm import mosaic

        if not (mosaic.is_available() or _interpreting()):
            return ("the FP8 Mosaic GPU kernels need a Hopper (sm_90) GPU as the default device, "
                    f"or Pallas GPU interpret mode; the default device is {jax.devices()[0].platform}")
    elif backend != "mosaic":
        return f"the bf16 grouped GEMM backend is {backend} (the FP8 kernels need a Hopper GPU)"
    _, k, n = w_shape
    if k % _KERNEL_DIM or n % _KERNEL_DIM:
        return f"w is {tuple(w_shape)}: the FP8 kernels need K and N multiples of {_KERNEL_DIM}"
    return ""


@functools.cache
def _say_once(recipe: str, device_kind: str, backend: str, why: str = "",
              schedule: str = "default"):
    if schedule != "default" and backend != "fp8_kernel":
        _log.warning("gmm_fp8_kernel_schedule=%s has no effect: the FP8 kernels do not run "
                     "here (%s).", schedule, why or f"{recipe} with impl=emulate")
    if recipe == "te_mxfp8":
        _log.warning("te_mxfp8: MXFP8 is emulated on %s (no MXFP8 tensor-core grouped GEMM is "
                     "used): operands are quantized to E4M3 with E8M0 scales per 32, "
                     "dequantized exactly to the compute dtype and multiplied by the %s "
                     "grouped GEMM. Numerics are MXFP8's; speed is bf16's.", device_kind, backend)
    elif backend == "fp8_kernel":
        _log.warning("te_fp8_blockwise: FP8 E4M3 Mosaic GPU grouped GEMM kernels on %s "
                     "(impl=kernel: fwd, dgrad and wgrad on FP8 codes with 1x128 / 128x128 "
                     "scales%s).", device_kind,
                     f"; kernel schedule {schedule}" if schedule != "default"
                     else f"; kernel schedule {DEFAULT_KERNEL_SCHEDULE}, the default")
    else:
        _log.warning("te_fp8_blockwise: FP8 blockwise numerics (1x128 / 128x128 scales) through "
                     "the %s bf16 grouped GEMM on %s (impl=emulate%s), so speed is bf16's.",
                     backend, device_kind, f", chosen by auto: {why}" if why else "")


def _impl(name):
    return importlib.import_module(f"dropless.ops.gmm.{name}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _qgmm(x, w, group_sizes, recipe, backend, out_dtype, aligned):
    return _impl(backend).gmm(qdq(x, recipe, 1), qdq(w, recipe, 1), group_sizes,
                              transpose_rhs=False, out_dtype=out_dtype)


def _qgmm_fwd(x, w, group_sizes, recipe, backend, out_dtype, aligned):
    return _qgmm(x, w, group_sizes, recipe, backend, out_dtype, aligned), (x, w, group_sizes)


def _qgmm_bwd(recipe, backend, out_dtype, aligned, res, dy):
    x, w, group_sizes = res
    impl = _impl(backend)
    # dy is quantized as it arrives and dequantized to the compute dtype (exact),
    # not rounded to it first. Blockwise weights: the same 128x128 blocks serve w
    # and w^T (qdq ignores the axis for 3-D operands).
    dx = impl.gmm(qdq(dy, recipe, 1, x.dtype), qdq(w, recipe, 2), group_sizes,
                  transpose_rhs=True, out_dtype=x.dtype)
    xm, dym, sizes_m = _wgrad_rows(x, dy, group_sizes, _ALIGNMENT[recipe], aligned)
    dw = impl.tgmm(qdq(xm, recipe, 0), qdq(dym, recipe, 0, x.dtype), sizes_m,
                   num_groups=w.shape[0], out_dtype=w.dtype)
    return dx, dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)


_qgmm.defvjp(_qgmm_fwd, _qgmm_bwd)


# ----------------------------------------------------------------------------
# impl="kernel": the FP8 Mosaic GPU kernels.


def pad_kernel_rows(a):
    """a [M, *] with zero rows appended up to a whole 128-row scale block: the rows
    the FP8 kernels run on (wgrad's M-major operands need it; the padding rows lie
    past the groups' total, so every product ignores them)."""
    pad = -a.shape[0] % quant.BLOCKWISE_TILE
    return a if not pad else jnp.pad(a, ((0, pad), (0, 0)))


class Quantizer(NamedTuple):
    """How ``impl="kernel"`` quantizes its operands: one of ``QUANT_IMPLS``, resolved
    by ``quantizer``. All give the same codes and scales bit for bit.

    weight:      w [G, K, N] -> (wq [G, K, N] E4M3, sw [G, Kb, Nb]), 128x128 blocks
    weight_both: w -> (wq, wq as [G, N, K], sw): both byte layouts from one read
    rows:        a [M, C], M a multiple of 128 -> (aq [M, C], sa [Cb, M]), 1x128 blocks
    columns:     a [M, C] -> (aq [C, M], sa [Mb, C]), 128x1 blocks, codes M-major
    rows_and_columns: a -> (*rows(a), *columns(a)); the Pallas one reads a once
    """

    name: str
    weight: Callable
    weight_both: Callable
    rows: Callable
    columns: Callable
    rows_and_columns: Callable


def quantizer(quant_impl: str) -> Quantizer:
    """The ``Quantizer`` of ``quant_impl`` (``QUANT_IMPLS``); the one place it is decided:
    ``auto`` quantizes each bfloat16 operand with ``fp8_quant_mgpu`` (Mosaic GPU, which
    reads bfloat16 only) and any other with ``fp8_quant_kernels`` (Triton); ``mosaic``
    takes every operand to ``fp8_quant_mgpu`` (bfloat16 only). One object per choice,
    so it serves as a static argument.

    Why Mosaic GPU (measured on an H200): the weight kernel quantizes DeepSeek-V3's
    expert weights in 1.05 ms against Triton's 1.29 ms, and XLA hands it each layer's
    slice of the stacked weights in place where it copies the slice out for the
    Triton call (``fp8_quant_weight-20261202-163640``, ``fp8_weight_slice-20261202-163627``);
    the 128x1 columns kernel runs at 1.17x a plain copy's bandwidth against Triton's
    0.57x, the fused rows-and-columns one at 0.96x against 0.59x (65536 x 2048,
    ``fp8_quant_columns-20261202-232231``). The FP8 proxy step: 1.088x bf16 with every
    operand on Mosaic GPU against 1.078x with Mosaic weights and Triton activations, in
    one run (``step-20261203-054415``; profiles ``profile-20261203-053730`` / ``-053625``:
    340.9 against 346.6 ms per step).

    Raises:
      ValueError: unknown ``quant_impl``.
    """
    if quant_impl not in QUANT_IMPLS:
        raise ValueError(f"gmm: quant_impl {quant_impl!r} is not one of {QUANT_IMPLS}")
    return _quantizer(quant_impl)


def _by_dtype(name):
    """``auto``'s quantizer ``name`` (``quantize_weight``, ``quantize_rows``, ...):
    ``fp8_quant_mgpu``'s for a bfloat16 operand, else ``fp8_quant_kernels``'s."""
    from dropless.ops.gmm import fp8_quant_kernels, fp8_quant_mgpu

    def quantize(a, **kwargs):
        kernels = fp8_quant_mgpu if jnp.dtype(a.dtype) == jnp.bfloat16 else fp8_quant_kernels
        return getattr(kernels, name)(a, **kwargs)

    quantize.__name__ = f"auto_{name}"
    return quantize


@functools.cache
def _quantizer(name: str) -> Quantizer:
    from dropless.ops.gmm import fp8_quant_kernels, fp8_quant_mgpu, mosaic_fp8, mosaic_fp8_tgmm

    if name == "xla":
        def both(w):
            wq, sw = mosaic_fp8.quantize_weight(w)
            return wq, jnp.swapaxes(wq, 1, 2), sw

        def rows_and_columns(a):
            return (*mosaic_fp8.quantize_rows(a), *mosaic_fp8_tgmm.quantize_columns(a))

        return Quantizer("xla", mosaic_fp8.quantize_weight, both, mosaic_fp8.quantize_rows,
                         mosaic_fp8_tgmm.quantize_columns, rows_and_columns)
    if name == "auto":
        weight, rows, columns, both = (_by_dtype(f"quantize_{op}")
                                       for op in ("weight", "rows", "columns", "rows_and_columns"))
        return Quantizer(name, functools.partial(weight, transposed=False), weight, rows, columns, both)
    kernels = {"mosaic": fp8_quant_mgpu, "pallas": fp8_quant_kernels}[name]
    return Quantizer(name, functools.partial(kernels.quantize_weight, transposed=False),
                     kernels.quantize_weight, kernels.quantize_rows, kernels.quantize_columns,
                     kernels.quantize_rows_and_columns)


def _schedule(name: str, product: str) -> dict:
    """The kernel keyword arguments of schedule ``name`` (``KERNEL_SCHEDULES``) for
    ``product``: ``"gmm"`` (fwd, dgrad) or ``"tgmm"`` (wgrad)."""
    if name not in KERNEL_SCHEDULES:
        raise ValueError(f"gmm: kernel schedule {name!r} is not one of {tuple(KERNEL_SCHEDULES)}")
    return dict(KERNEL_SCHEDULES[name][product == "tgmm"])


def _fwd_from_codes(x, wq_t, sw, group_sizes, out_dtype, q: Quantizer, schedule="default",
                    x_rows=None):
    """y [M, N]; ``x_rows``: x's 1x128 codes and scales when already quantized."""
    from dropless.ops.gmm import mosaic_fp8

    xq, sx = x_rows or q.rows(pad_kernel_rows(x))
    y = mosaic_fp8.gmm_fp8_blockwise(xq, sx, wq_t, sw, group_sizes, out_dtype=out_dtype,
                                     **_schedule(schedule, "gmm"))
    return y[:x.shape[0]]


def _fwd_keeping_x(x, wq_t, sw, group_sizes, out_dtype, aligned, q: Quantizer, schedule):
    """(y, x's residual) of the custom_vjp's forward. Where ``aligned``, wgrad reads x's
    rows as they lie, so x is quantized into both layouts in one read (1x128 codes for
    this product, 128x1 codes for wgrad; the same bits as two passes) and the residual
    is the 128x1 codes and scales, named ``moe_fp8_input_codes`` so that a remat policy
    keeps them (``minimal`` does): the backward pass then neither recomputes x nor
    quantizes it again, and the residual takes 1 byte per element of x instead of 2.
    Otherwise (wgrad regroups x first) the residual is x."""
    if not aligned:
        return _fwd_from_codes(x, wq_t, sw, group_sizes, out_dtype, q, schedule), x
    xq, sx, xq_c, sx_c = q.rows_and_columns(pad_kernel_rows(x))
    y = _fwd_from_codes(x, wq_t, sw, group_sizes, out_dtype, q, schedule, (xq, sx))
    return y, tuple(checkpoint_name(a, "moe_fp8_input_codes") for a in (xq_c, sx_c))


def _dgrad_from_codes(dy, wq, sw, group_sizes, out_dtype, q: Quantizer, dy_rows=None,
                      schedule="default"):
    """dx [M, K]; ``dy_rows``: dy's 1x128 codes and scales when already quantized."""
    from dropless.ops.gmm import mosaic_fp8

    dyq, sdy = dy_rows or q.rows(pad_kernel_rows(dy))
    dx = mosaic_fp8.gmm_fp8_blockwise(dyq, sdy, wq, jnp.swapaxes(sw, 1, 2), group_sizes,
                                      out_dtype=out_dtype, **_schedule(schedule, "gmm"))
    return dx[:dy.shape[0]]


def _fwd(x, w, group_sizes, out_dtype, q: Quantizer, schedule="default"):
    _, wq_t, sw = q.weight_both(w)
    return _fwd_from_codes(x, wq_t, sw, group_sizes, out_dtype, q, schedule)


def _wgrad_from_codes(x_columns, dy_columns, group_sizes, out_dtype, schedule="default"):
    """dw [G, K, N] from x's and dy's 128x1 codes and scales (rows grouped as
    ``group_sizes`` says, every group a multiple of 128 rows)."""
    from dropless.ops.gmm import mosaic_fp8_tgmm

    return mosaic_fp8_tgmm.tgmm_fp8_blockwise(*x_columns, *dy_columns, group_sizes,
                                               out_dtype=out_dtype, **_schedule(schedule, "tgmm"))


def _wgrad(x, dy, group_sizes, out_dtype, aligned, q: Quantizer, dy_columns=None,
           schedule="default"):
    """dw [G, K, N] from x and dy, regrouped first unless ``aligned``; ``dy_columns``:
    dy's 128x1 codes and scales when already quantized (only where ``aligned``:
    otherwise wgrad's dy is a regrouped copy)."""
    x, dy, group_sizes = _wgrad_rows(x, dy, group_sizes, quant.BLOCKWISE_TILE, aligned)
    x_columns = q.columns(pad_kernel_rows(x))
    dy_columns = dy_columns or q.columns(pad_kernel_rows(dy))
    return _wgrad_from_codes(x_columns, dy_columns, group_sizes, out_dtype, schedule)


def kernel_fwd(x, w, group_sizes, out_dtype, quant_impl="xla"):
    """y [M, N] of ``impl="kernel"``: x 1x128, w 128x128 (codes as [G, N, K]), FP8 kernel."""
    return _fwd(x, w, group_sizes, out_dtype, quantizer(quant_impl))


def kernel_dgrad(dy, w, group_sizes, out_dtype, quant_impl="xla"):
    """dx [M, K] of ``impl="kernel"`` from w: dy 1x128 along N, w's 128x128 codes as stored.

    (The custom_vjp's backward does not call this: it reuses the forward's codes.)
    """
    q = quantizer(quant_impl)
    wq, sw = q.weight(w)
    return _dgrad_from_codes(dy, wq, sw, group_sizes, out_dtype, q)


def kernel_wgrad(x, dy, group_sizes, out_dtype, aligned=False, quant_impl="xla"):
    """dw [G, K, N] of ``impl="kernel"``: x and dy 128x1 along M, M-major codes.

    ``aligned``: group sizes are known to be multiples of 128; otherwise the
    rows are regrouped first (``align_groups``).
    """
    return _wgrad(x, dy, group_sizes, out_dtype, aligned, quantizer(quant_impl))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _kgmm(x, w, group_sizes, out_dtype, aligned, q: Quantizer, schedule):
    return _fwd(x, w, group_sizes, out_dtype, q, schedule)


def _kgmm_fwd(x, w, group_sizes, out_dtype, aligned, q: Quantizer, schedule):
    # The weight is quantized once, into both byte layouts (the forward reads the
    # transposed copy, dgrad the natural one: FP8 wgmma reads both operands K-major):
    # the natural codes (one byte per weight) are the backward's residual, so dgrad
    # does not quantize w again. An empty array carries w's dtype for dw.
    # Named so a remat policy can keep them (``minimal`` does) instead of quantizing
    # the weight again when the backward pass recomputes the layer.
    wq, wq_t, sw = q.weight_both(w)
    y, x_res = _fwd_keeping_x(x, wq_t, sw, group_sizes, out_dtype, aligned, q, schedule)
    wq, sw = checkpoint_name(wq, "moe_fp8_weights"), checkpoint_name(sw, "moe_fp8_weights")
    return y, (x_res, wq, sw, group_sizes, jnp.zeros((0,), w.dtype), jnp.zeros((0,), x.dtype))


def _kgmm_bwd(out_dtype, aligned, q: Quantizer, schedule, res, dy):
    x_res, wq, sw, group_sizes, w_dtype, x_dtype = res
    dy_rows = dy_columns = None
    if aligned:
        # wgrad reads the same dy rows as dgrad (no regrouping): both copies of dy
        # (1x128 and 128x1) from one read of it, the same bits as two passes; x's
        # 128x1 codes came from the forward (``_fwd_keeping_x``).
        dyq, sdy, dyq_c, sdy_c = q.rows_and_columns(pad_kernel_rows(dy))
        dy_rows, dy_columns = (dyq, sdy), (dyq_c, sdy_c)
    dx = _dgrad_from_codes(dy, wq, sw, group_sizes, x_dtype.dtype, q, dy_rows, schedule)
    if aligned:  # x_res: x's 128x1 codes and scales
        dw = _wgrad_from_codes(x_res, dy_columns, group_sizes, w_dtype.dtype, schedule)
    else:  # x_res: x
        dw = _wgrad(x_res, dy, group_sizes, w_dtype.dtype, aligned, q, schedule=schedule)
    return dx, dw, jnp.zeros(group_sizes.shape, jax.dtypes.float0)


_kgmm.defvjp(_kgmm_fwd, _kgmm_bwd)


def weight_codes(w, quant_impl="auto"):
    """w [G, K, N]'s FP8 codes as the kernel path reads them: ``(wq [G, K, N], wq as
    [G, N, K], sw [G, Kb, Nb])``, 128x128 blocks, from one read (``Quantizer.weight_both``;
    no gradient flows through them).

    For ``gmm(w_codes=...)``: computed once per optimizer step, outside the
    gradient-accumulation loop, they spare each further micro-batch the quantization
    of the same weights (``train.step``). A stack [L, G, K, N] is quantized as L x G
    groups (the blocks never cross a group), so slicing layer l out of its codes gives
    the codes of w[l].
    """
    if quant_impl not in QUANT_IMPLS:
        raise ValueError(f"weight_codes: quant_impl {quant_impl!r} is not one of {QUANT_IMPLS}")
    w = jax.lax.stop_gradient(w)
    lead = w.shape[:-2]
    wq, wq_t, sw = quantizer(quant_impl).weight_both(w.reshape(-1, *w.shape[-2:]))
    return tuple(a.reshape(*lead, *a.shape[1:]) for a in (wq, wq_t, sw))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _kgmm_codes(x, w, wq, wq_t, sw, group_sizes, out_dtype, aligned, q: Quantizer, schedule):
    return _fwd_from_codes(x, wq_t, sw, group_sizes, out_dtype, q, schedule)


def _kgmm_codes_fwd(x, w, wq, wq_t, sw, group_sizes, out_dtype, aligned, q, schedule):
    # w itself is not read: its codes come in (weight_codes of this very w), and it
    # stays an argument so that dw is its gradient. The codes are inputs, so keeping
    # wq for dgrad costs no memory of its own.
    y, x_res = _fwd_keeping_x(x, wq_t, sw, group_sizes, out_dtype, aligned, q, schedule)
    return y, (x_res, wq, sw, group_sizes, jnp.zeros((0,), w.dtype), jnp.zeros((0,), x.dtype))


def _kgmm_codes_bwd(out_dtype, aligned, q, schedule, res, dy):
    _, wq, sw, _, _, _ = res
    dx, dw, dgs = _kgmm_bwd(out_dtype, aligned, q, schedule, res, dy)
    # The codes are constants of the step: zero cotangents (dead code under jit).
    g, k, n = wq.shape
    return (dx, dw, jnp.zeros_like(wq), jnp.zeros((g, n, k), wq.dtype), jnp.zeros_like(sw), dgs)


_kgmm_codes.defvjp(_kgmm_codes_fwd, _kgmm_codes_bwd)


def _swiglu_codes(q: Quantizer, gu, layout):
    """(codes, scales) of ``fp8_quant_mgpu.swiglu(gu)`` in ``layout`` (``"rows"``, 1x128,
    or ``"columns"``, 128x1, as ``q.rows`` / ``q.columns``): where q quantizes bf16 with
    Mosaic GPU (``auto``, ``mosaic``), one kernel reads gu and never writes h; else h
    (XLA, which fuses it into XLA's own quantization) and q's pass over it.

    The one-pass kernels run on half tiles, 16 along M, two steps in flight: on an H200 at
    gu = [65536, 4096] they took 0.203 (rows) and 0.205 ms (columns) against 0.365 for the
    whole tiles and 0.306 / 0.301 for XLA's SwiGLU then the plain pass, the same bits
    (``fp8_quant_swiglu-20261207-181610``)."""
    from dropless.ops.gmm import fp8_quant_mgpu

    gu = pad_kernel_rows(gu)
    if q.name in ("auto", "mosaic") and jnp.dtype(gu.dtype) == jnp.bfloat16:
        return getattr(fp8_quant_mgpu, f"swiglu_quantize_{layout}")(gu, m_tiles=16, half_tiles=True)
    return getattr(q, layout)(fp8_quant_mgpu.swiglu(gu))


def _swiglu_vjp(gu, dh):
    """d gu [M, 2C] of ``fp8_quant_mgpu.swiglu`` at gu for dh [M, C] (float32 inside)."""
    from dropless.ops.gmm import fp8_quant_mgpu

    f32 = lambda gu: fp8_quant_mgpu._swiglu_f32(*jnp.split(gu, 2, axis=-1))  # noqa: E731
    _, vjp = jax.vjp(f32, gu.astype(jnp.float32))
    return vjp(dh.astype(jnp.float32))[0].astype(gu.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _kgmm_swiglu(gu, w, codes, group_sizes, out_dtype, q: Quantizer, schedule):
    return _kgmm_swiglu_fwd(gu, w, codes, group_sizes, out_dtype, q, schedule)[0]


def _kgmm_swiglu_fwd(gu, w, codes, group_sizes, out_dtype, q: Quantizer, schedule):
    # As _kgmm_fwd (or _kgmm_codes_fwd with ``codes``), but the operand is swiglu(gu),
    # quantized where it is computed; the residual is gu (the gate/up GEMM's output,
    # which the remat policies name ``moe_mlpwi``), not h.
    from dropless.ops.gmm import mosaic_fp8

    if codes is None:
        wq, wq_t, sw = q.weight_both(w)
        wq, sw = checkpoint_name(wq, "moe_fp8_weights"), checkpoint_name(sw, "moe_fp8_weights")
    else:
        wq, wq_t, sw = codes
    hq, sh = _swiglu_codes(q, gu, "rows")
    y = mosaic_fp8.gmm_fp8_blockwise(hq, sh, wq_t, sw, group_sizes, out_dtype=out_dtype,
                                     **_schedule(schedule, "gmm"))
    return y[:gu.shape[0]], (gu, wq, sw, group_sizes, jnp.zeros((0,), w.dtype), codes)


def _kgmm_swiglu_bwd(out_dtype, q: Quantizer, schedule, res, dy):
    gu, wq, sw, group_sizes, w_dtype, codes = res
    dyq, sdy, dyq_c, sdy_c = q.rows_and_columns(pad_kernel_rows(dy))
    dh = _dgrad_from_codes(dy, wq, sw, group_sizes, gu.dtype, q, (dyq, sdy), schedule)
    dw = _wgrad_from_codes(_swiglu_codes(q, gu, "columns"), (dyq_c, sdy_c), group_sizes,
                           w_dtype.dtype, schedule)
    # The codes are constants of the step: zero cotangents (dead code under jit).
    dcodes = None if codes is None else tuple(jnp.zeros_like(c) for c in codes)
    return (_swiglu_vjp(gu, dh), dw, dcodes, jnp.zeros(group_sizes.shape, jax.dtypes.float0))


_kgmm_swiglu.defvjp(_kgmm_swiglu_fwd, _kgmm_swiglu_bwd)


def _interpreting():
    """True inside ``plgpu.force_gpu_interpret_mode`` (Pallas keeps it in this private flag)."""
    from jax._src import config as jax_config

    flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
    return flag is not None and flag.value is not None


def gmm(x, w, group_sizes, *, recipe="te_no_quant", backend="auto", out_dtype=None,
        impl="auto", groups_aligned=False, quant_impl="auto", kernel_schedule="default",
        w_codes=None, prologue=None):
    """Grouped matmul with the FP8 numerics of ``recipe`` in all three products.

    Args:
      x: [M, K] rows sorted by group; w: [G, K, N], same dtype (the compute
        dtype the operands are dequantized to; bf16 for the Mosaic kernels).
      group_sizes: [G] int32, any sizes (module docstring, "Group alignment").
      recipe: one of ``RECIPES``; ``te_no_quant`` is ``api.gmm`` unchanged.
      backend: the bf16 gmm backend (``api.BACKENDS``) of ``impl="emulate"``.
      out_dtype: output dtype (default x.dtype); accumulation is float32.
      impl: ``"auto"``, ``"emulate"`` or ``"kernel"`` (``IMPLS``; module
        docstring; ``resolve_impl``).
      quant_impl: how the kernels quantize their operands (``QUANT_IMPLS``;
        ``auto`` is ``mosaic`` for bfloat16 operands, ``pallas`` for others).
      groups_aligned: the caller guarantees every group size is a multiple
        of ``required_alignment(recipe)``, so wgrad needs no regrouping.
      kernel_schedule: how the FP8 kernels schedule their steps (``KERNEL_SCHEDULES``;
        the same bits with each). Inert where the kernels do not run (``impl`` resolves
        to ``emulate``, or another recipe).
      w_codes: ``weight_codes(w, quant_impl)``, computed by the caller (once per
        optimizer step under gradient accumulation): the kernel path then reads them
        instead of quantizing w (the same codes, so the same bits). They must be this
        w's, by this ``quant_impl``: nothing under ``jit`` can check that. Unused
        where the emulation runs (and then dead code under ``jit``).
      prologue: ``None``, or ``"swiglu"`` (``PROLOGUES``): x is then gu [M, 2K] =
        [gate | up] and the operand is SwiGLU's output silu(gate) * up [M, K]. Where the
        FP8 kernels run with ``groups_aligned``, it is quantized where it is computed:
        one Mosaic GPU pass reads gu and writes h's codes (h is never written), the
        backward recomputes h in its 128x1 quantizer the same way, and the residual is
        gu, not h; h is computed in float32 and rounded to x's dtype once
        (``fp8_quant_mgpu.swiglu``). Elsewhere exactly ``gmm(jax.nn.silu(gate) * up,
        ...)`` (XLA's SwiGLU, which rounds after each operation); the gradient is gu's.

    Returns:
      [M, N]; rows past ``sum(group_sizes)`` are zeros. Differentiable in x
      and w (dgrad and wgrad quantized as in the module docstring).

    Raises:
      ValueError: unknown recipe, impl, quant_impl, kernel_schedule or prologue; x of
        odd width with ``prologue="swiglu"``;
        ``impl="kernel"`` with another recipe than ``te_fp8_blockwise``, off a
        Hopper GPU outside interpret mode, or with K or N not a multiple of 256;
        what ``api.gmm`` raises for the shapes.
    """
    required_alignment(recipe)
    if impl not in IMPLS:
        raise ValueError(f"gmm: impl {impl!r} is not one of {IMPLS}")
    if quant_impl not in QUANT_IMPLS:
        raise ValueError(f"gmm: quant_impl {quant_impl!r} is not one of {QUANT_IMPLS}")
    _schedule(kernel_schedule, "gmm")  # checked on every path, where it runs or not
    if prologue not in PROLOGUES:
        raise ValueError(f"gmm: prologue {prologue!r} is not one of {PROLOGUES}")
    gu = None
    if prologue == "swiglu":
        if x.ndim != 2 or x.shape[1] % 2:
            raise ValueError(f"gmm: prologue='swiglu' takes x = [gate | up] of shape [M, 2K], "
                             f"got {x.shape}")
        gate, up = jnp.split(x, 2, axis=-1)
        gu, x = x, jax.nn.silu(gate) * up  # XLA's SwiGLU; dead code where gu is fused
    if recipe == "te_no_quant":
        return api.gmm(x, w, group_sizes, backend=backend, out_dtype=out_dtype)
    api._check_gmm_args(x, w, group_sizes, transpose_rhs=False)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    name = api.resolve_backend(backend, x.shape, w.shape, x.dtype)
    impl, why = resolve_impl(impl, recipe, name, x.shape, w.shape, x.dtype)
    if impl == "kernel":
        if why := _kernel_refusal(recipe, w.shape):
            raise ValueError(f"gmm: impl='kernel' (config key gmm_fp8_impl): {why}; use impl='emulate'")
        _say_once(recipe, jax.devices()[0].device_kind, "fp8_kernel", schedule=kernel_schedule)
        if w_codes is not None:
            wq, wq_t, sw = w_codes
            g, k, n = w.shape
            want = ((g, k, n), (g, n, k), (g, -(-k // quant.BLOCKWISE_TILE), -(-n // quant.BLOCKWISE_TILE)))
            if (wq.shape, wq_t.shape, sw.shape) != want:
                raise ValueError(f"gmm: w_codes have shapes {wq.shape}, {wq_t.shape}, {sw.shape}; "
                                 f"w {tuple(w.shape)} needs {want} (weight_codes(w))")
        if gu is not None and groups_aligned:
            return _kgmm_swiglu(gu, w, None if w_codes is None else tuple(w_codes), group_sizes,
                                out_dtype, quantizer(quant_impl), kernel_schedule)
        if w_codes is not None:
            return _kgmm_codes(x, w, wq, wq_t, sw, group_sizes, out_dtype, bool(groups_aligned),
                               quantizer(quant_impl), kernel_schedule)
        return _kgmm(x, w, group_sizes, out_dtype, bool(groups_aligned), quantizer(quant_impl),
                     kernel_schedule)
    _say_once(recipe, jax.devices()[0].device_kind, name, why, kernel_schedule)
    return _qgmm(x, w, group_sizes, recipe, name, out_dtype, bool(groups_aligned))
