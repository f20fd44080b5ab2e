"""What the FP8 grouped GEMMs pay besides the GEMM: the quantization passes, and where the time goes.

Legend: M rows, K x N the weight dims (w [G, K, N]), G groups.

For one shape (default DeepSeek-V3's gate|up at M=65536, G=32, K=7168,
N=4096) this times, on random data, each pass the ``te_fp8_blockwise``
kernel path (``quantized.gmm(impl="kernel")``) runs before its kernels:

  rows      x [M, K] -> 1x128 codes [M, K] + scales [Kb, M]   (fwd; dgrad's dy alike)
  columns   x [M, K] -> 128x1 codes transposed [K, M] + scales (wgrad's x and dy)
  weight    w [G, K, N] -> 128x128 codes [G, K, N] + scales   (dgrad's layout)
  weight2   the same plus the transposed byte copy [G, N, K]    (what the forward reads)
  qdq_rows  the emulation's quantize-dequantize of x (bf16 out, codes kept)

and reports each pass's kernel time (CUPTI, ``mosaic.gpu.profiler.measure``)
and wall-clock time (jitted call, back to back, median), its bytes (input
read once, outputs written once) and GB/s next to a plain bf16 elementwise
pass over x (``copy``: read + write) measured in the same process, the
bandwidth ceiling a fused pass could reach. Then the whole products, fwd
and fwd+dgrad+wgrad of the kernel path with each quantizer (``auto q``: the
model's default, Mosaic GPU for bfloat16 operands; ``pallas q``; unmarked:
XLA's) against the FP8 kernels alone and the bf16 kernel, and a per-kernel
breakdown (``jax.profiler`` trace) of the default path's fwd+bwd, so the
passes that cost most are named.

Run on the GPU machine:
  PYTHONPATH=src python3 benchmarks/fp8_quant.py [--shape M,G,K,N] [--out DIR]
``--smoke`` runs a tiny shape on CPU (interpret mode for the kernels is too
slow: the kernel rows are skipped there) to check the script.

``--columns-variants`` runs a sweep instead, for each activation shape of
``--variant-shapes`` (default [65536, C] bf16 for C = 7168, 4096, 2048): the
Pallas rows kernel, the Pallas columns kernel at each warp count
(``fp8_quant_kernels.NUM_WARPS``), rows + columns as two kernels, the fused
``quantize_rows_and_columns`` at each warp count, and the Mosaic GPU kernels
of ``fp8_quant_mgpu`` (rows, columns, both) at each tile walk and pipeline
depth of ``COLUMNS_DEPTHS``, each against a plain bf16 copy of the same array
in the same run (CUPTI and wall-clock, GB/s; each Mosaic GPU kernel's outputs
checked bit for bit against the Pallas kernel's of its layout, the columns
against the first warp count's, the fused ones against the two Pallas
kernels'). The Mosaic GPU variants need a Hopper GPU; with ``--smoke`` on CPU
they run in Pallas GPU interpret mode, to check the script. Its record is of kind
``fp8_quant_columns`` (the report's FP8 section keeps reading the passes
record).

``--swiglu-variants`` likewise sweeps the one-pass SwiGLU quantizers
(``swiglu_quantize_rows`` and ``_columns``) at each tile walk and pipeline depth of
``SWIGLU_DEPTHS`` (and with half tiles, ``SWIGLU_HALF_DEPTHS``), for each gu = [gate | up]
of ``--swiglu-shapes``, against XLA's
SwiGLU then the Mosaic pass of the same layout (bit for bit) and a bf16 copy of gu;
record kind ``fp8_quant_swiglu``; ``--smoke`` runs it in interpret mode on CPU.

``--weight-variants`` (Hopper GPU) likewise sweeps the weight quantizers at each
w [G, K, N] of ``--weight-shapes`` (default DeepSeek-V3's 32 x 7168 x 4096 and
Qwen3-30B-A3B's 128 x 2048 x 1536, 128 x 768 x 2048): the Triton kernel
(``fp8_quant_kernels``) and the Mosaic GPU kernel (``fp8_quant_mgpu``) at each
pipeline depth (``WEIGHT_DEPTHS``), both layouts and the natural one alone,
against a bf16 copy of w, each Mosaic output checked bit for bit against the
Triton one's; record kind ``fp8_quant_weight``. The passes table above has the
Mosaic kernels' rows too (``weight_mosaic``, ``weight2_mosaic``, ``rows_mosaic``,
``columns_mosaic``) on a Hopper GPU, and SwiGLU's output quantized from x read as
gu = [gate | up]: XLA's SwiGLU then the Mosaic pass (``swiglu_then_rows``,
``swiglu_then_columns``) against the one-pass kernels (``swiglu_rows_mosaic``,
``swiglu_columns_mosaic``), checked bit for bit against them.
"""

import argparse
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dropless.ops import quant  # noqa: E402
from dropless.ops.gmm import (  # noqa: E402
    api,
    fp8_quant_kernels,
    fp8_quant_mgpu,
    mosaic,
    mosaic_fp8,
    mosaic_fp8_tgmm,
    quantized,
)
from dropless.perf import measure  # noqa: E402


def cupti_ms(fn, args, iters):
    """Median summed kernel time of one call (ms), or None where CUPTI is unavailable."""
    try:
        return statistics.median(measure.cupti_kernel_ms(fn, *args, iters=iters))
    except Exception:  # noqa: BLE001 - CPU, or no CUPTI
        return None


def wall_ms(fn, args, iters):
    return measure.time_fn(fn, *args, warmup=2, iters=iters)["median_ms"]


def columns_direct(x_MK):
    """``quantize_columns``'s earlier formulation: 128x1 blocks of x, codes transposed."""
    q, s = quant.quantize_blocks(x_MK, (128, 1))
    return q.T, s


def passes(m, g, k, n):
    """name -> (fn, which input, bytes moved)."""
    e = m * k
    wn = g * k * n
    return {
        "copy": (lambda x: x * 2, "x", 4 * e),
        "rows": (mosaic_fp8.quantize_rows, "x", 2 * e + e + 4 * e // 128),
        "columns": (mosaic_fp8_tgmm.quantize_columns, "x", 2 * e + e + 4 * e // 128),
        "weight": (mosaic_fp8.quantize_weight, "w", 2 * wn + wn + 4 * wn // 128**2),
        "weight2": (lambda w: (lambda q, s: (q, jnp.swapaxes(q, 1, 2), s))(
            *mosaic_fp8.quantize_weight(w)), "w", 2 * wn + 2 * wn + 4 * wn // 128**2),
        "columns_direct": (columns_direct, "x", 2 * e + e + 4 * e // 128),
        "qdq_rows": (lambda x: quant.qdq_blocks(x, (1, 128)), "x", 2 * e + 2 * e),
        # The single-pass kernels (fp8_quant_kernels): same outputs as rows,
        # columns, weight and weight2.
        "rows_pallas": (fp8_quant_kernels.quantize_rows, "x", 2 * e + e + 4 * e // 128),
        "columns_pallas": (fp8_quant_kernels.quantize_columns, "x", 2 * e + e + 4 * e // 128),
        "weight_pallas": (lambda w: fp8_quant_kernels.quantize_weight(w, transposed=False), "w",
                          2 * wn + wn + 4 * wn // 128**2),
        "weight2_pallas": (fp8_quant_kernels.quantize_weight, "w",
                           2 * wn + 2 * wn + 4 * wn // 128**2),
        # The Mosaic GPU kernels (fp8_quant_mgpu), on a Hopper GPU only.
        **({"weight_mosaic": (functools.partial(fp8_quant_mgpu.quantize_weight, transposed=False),
                              "w", 2 * wn + wn + 4 * wn // 128**2),
            "weight2_mosaic": (fp8_quant_mgpu.quantize_weight, "w",
                               2 * wn + 2 * wn + 4 * wn // 128**2),
            "rows_mosaic": (fp8_quant_mgpu.quantize_rows, "x", 2 * e + e + 4 * e // 128),
            "columns_mosaic": (fp8_quant_mgpu.quantize_columns, "x", 2 * e + e + 4 * e // 128),
            # SwiGLU's output quantized, x read as gu = [gate | up] (h [M, K / 2]): XLA's
            # SwiGLU then the Mosaic pass, against one Mosaic pass that never writes h
            # (gmm_fp8_fused_swiglu). Bytes: gu read, h's codes and scales written,
            # so the GB/s of the two compare the same useful work.
            "swiglu_then_rows": (lambda gu: fp8_quant_mgpu.quantize_rows(fp8_quant_mgpu.swiglu(gu)),
                                 "x", 2 * e + e // 2 + 2 * e // 128),
            "swiglu_rows_mosaic": (fp8_quant_mgpu.swiglu_quantize_rows, "x",
                                   2 * e + e // 2 + 2 * e // 128),
            "swiglu_then_columns": (lambda gu: fp8_quant_mgpu.quantize_columns(
                fp8_quant_mgpu.swiglu(gu)), "x", 2 * e + e // 2 + 2 * e // 128),
            "swiglu_columns_mosaic": (fp8_quant_mgpu.swiglu_quantize_columns, "x",
                                      2 * e + e // 2 + 2 * e // 128)}
           if mosaic.is_available() else {}),
    }


# pass -> the XLA pass whose outputs it must equal bit for bit
SAME_AS = {"rows_pallas": "rows", "columns_pallas": "columns", "weight_pallas": "weight",
           "weight2_pallas": "weight2", "weight_mosaic": "weight", "weight2_mosaic": "weight2",
           "rows_mosaic": "rows", "columns_mosaic": "columns",
           "swiglu_rows_mosaic": "swiglu_then_rows", "swiglu_columns_mosaic": "swiglu_then_columns"}


def _bits(a):
    """a's bytes as unsigned integers (NaNs compare equal bit for bit)."""
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])


def x_quantized_twice(gs, quant_impl="auto", schedule="default"):
    """The kernel path's fwd+bwd as it ran until 2026-12-05, the baseline of x's codes
    kept from the forward (``quantized._fwd_keeping_x``): the forward quantizes x in 1x128
    blocks and keeps x itself; the backward quantizes x again in 128x1 blocks for wgrad.
    The same kernels and quantizers otherwise, so the same bits."""
    q = quantized.quantizer(quant_impl)

    def fwd(x, w):
        wq, wq_t, sw = q.weight_both(w)
        y = quantized._fwd_from_codes(x, wq_t, sw, gs, x.dtype, q, schedule)
        return y, (x, wq, sw, jnp.zeros((0,), w.dtype))

    def bwd(res, dy):
        x, wq, sw, w_dtype = res
        dyq, sdy, dyq_c, sdy_c = q.rows_and_columns(quantized.pad_kernel_rows(dy))
        dx = quantized._dgrad_from_codes(dy, wq, sw, gs, x.dtype, q, (dyq, sdy), schedule)
        dw = quantized._wgrad(x, dy, gs, w_dtype.dtype, True, q, (dyq_c, sdy_c), schedule)
        return dx, dw

    f = jax.custom_vjp(lambda x, w: fwd(x, w)[0])
    f.defvjp(fwd, bwd)
    return f


def products(x, w, gs, dy, schedules=()):
    """name -> (fn, args): the kernel path with each quantizer (``auto``, the default the
    model runs: Mosaic GPU for bfloat16 operands; ``pallas``; ``xla``), the FP8 kernels
    alone, the bf16 kernel; and the default path's fwd+bwd with each kernel schedule of
    ``schedules`` (``quantized.KERNEL_SCHEDULES``)."""
    kpath_a = lambda x, w: quantized.gmm(x, w, gs, recipe="te_fp8_blockwise", impl="kernel",  # noqa: E731
                                         groups_aligned=True, quant_impl="auto")
    kpath = lambda x, w: quantized.gmm(x, w, gs, recipe="te_fp8_blockwise", impl="kernel",  # noqa: E731
                                       groups_aligned=True, quant_impl="xla")
    kpath_p = lambda x, w: quantized.gmm(x, w, gs, recipe="te_fp8_blockwise", impl="kernel",  # noqa: E731
                                         groups_aligned=True, quant_impl="pallas")
    bf16 = lambda x, w: api.gmm(x, w, gs)  # noqa: E731

    def fwd_bwd(f):
        def run(x, w, dy):
            y, vjp = jax.vjp(f, x, w)
            return y, *vjp(dy)
        return jax.jit(run)

    wq, sw = mosaic_fp8.quantize_weight(w)
    fwd_ops = jax.block_until_ready(mosaic_fp8.fwd_operands(x, wq, sw))
    dgrad_ops = jax.block_until_ready(mosaic_fp8.dgrad_operands(dy, wq, sw))
    wgrad_ops = jax.block_until_ready(mosaic_fp8_tgmm.wgrad_operands(x, dy))
    kernels = jax.jit(lambda f, d, wg: (mosaic_fp8.gmm_fp8_blockwise(*f, gs),
                                        mosaic_fp8.gmm_fp8_blockwise(*d, gs),
                                        mosaic_fp8_tgmm.tgmm_fp8_blockwise(*wg, gs)))
    return {
        "fwd kernel path, auto quant": (jax.jit(kpath_a), (x, w)),
        "fwd kernel path": (jax.jit(kpath), (x, w)),
        "fwd kernel path, pallas quant": (jax.jit(kpath_p), (x, w)),
        "fwd FP8 kernel alone": (jax.jit(lambda o: mosaic_fp8.gmm_fp8_blockwise(*o, gs)),
                                 (fwd_ops,)),
        "fwd bf16 kernel": (jax.jit(bf16), (x, w)),
        "fwd+bwd kernel path, auto q": (fwd_bwd(kpath_a), (x, w, dy)),
        "fwd+bwd kernel path, auto q, x quantized twice": (fwd_bwd(x_quantized_twice(gs)),
                                                           (x, w, dy)),
        **{f"fwd+bwd kernel path, auto q, {s}": (fwd_bwd(functools.partial(
            quantized.gmm, group_sizes=gs, recipe="te_fp8_blockwise", impl="kernel",
            groups_aligned=True, quant_impl="auto", kernel_schedule=s)), (x, w, dy))
           for s in schedules},
        "fwd+bwd kernel path": (fwd_bwd(kpath), (x, w, dy)),
        "fwd+bwd kernel path, pallas q": (fwd_bwd(kpath_p), (x, w, dy)),
        "fwd+bwd FP8 kernels alone": (kernels, (fwd_ops, dgrad_ops, wgrad_ops)),
        "fwd+bwd bf16 kernel": (fwd_bwd(bf16), (x, w, dy)),
    }


def column_variants(m, c):
    """name -> (fn of a [M, C], bytes moved, the name whose outputs it must equal or None)."""
    fq, mg = fp8_quant_kernels, fp8_quant_mgpu
    e = m * c
    one = 2 * e + e + 4 * e // 128  # read a once, write one copy of codes and its scales
    both = one + e + 4 * e // 128  # read a once, write both copies
    with_mosaic = mosaic.is_available() or jax.devices()[0].platform == "cpu"

    def mosaic_variants(name, fn, nbytes, same_as):
        """fn at each tile walk and pipeline depth of ``COLUMNS_DEPTHS``."""
        return {f"{name} mosaic t{tiles} s{steps} o{slots}": (
            _mosaic_gpu(functools.partial(fn, m_tiles=tiles, max_concurrent_steps=steps,
                                          out_slots=slots)), nbytes, same_as)
            for tiles, steps, slots in COLUMNS_DEPTHS} if with_mosaic else {}

    out = {"copy": (lambda a: a * 2, 4 * e, None), "rows": (fq.quantize_rows, one, None),
           **mosaic_variants("rows", mg.quantize_rows, one, "rows")}
    warps = sorted(fq.NUM_WARPS)
    for w in warps:
        out[f"columns w{w}"] = (functools.partial(fq.quantize_columns, num_warps=w), one,
                                None if w == warps[0] else f"columns w{warps[0]}")
    out.update(mosaic_variants("columns", mg.quantize_columns, one, f"columns w{warps[0]}"))
    out["rows + columns"] = (lambda a: (*fq.quantize_rows(a), *fq.quantize_columns(a)), 2 * one, None)
    for w in warps:
        out[f"rows_and_columns w{w}"] = (
            functools.partial(fq.quantize_rows_and_columns, num_warps=w), both, "rows + columns")
    out.update(mosaic_variants("rows_and_columns", mg.quantize_rows_and_columns, both,
                               "rows + columns"))
    return out


def swiglu_variants(m, c):
    """name -> (fn of gu [M, C] = [gate | up], bytes moved, the name whose outputs it must
    equal or None): a bf16 copy of gu, XLA's SwiGLU then the Mosaic rows (columns) pass,
    and the one-pass ``swiglu_quantize_rows`` (``_columns``) at each of ``SWIGLU_DEPTHS`` and
    ``SWIGLU_HALF_DEPTHS`` (half tiles).
    Bytes as the passes table counts them: gu read, h's codes and scales written."""
    mg = fp8_quant_mgpu
    e = m * c
    nbytes = 2 * e + e // 2 + 2 * e // 128
    out = {"copy": (lambda a: a * 2, 4 * e, None)}
    for layout, plain, fused in (("rows", mg.quantize_rows, mg.swiglu_quantize_rows),
                                 ("columns", mg.quantize_columns, mg.swiglu_quantize_columns)):
        ref = f"swiglu then {layout}"
        out[ref] = (_mosaic_gpu(lambda a, plain=plain: plain(mg.swiglu(a))), nbytes, None)
        out.update({f"swiglu_{layout} t{tiles} s{steps} o{slots}": (
            _mosaic_gpu(functools.partial(fused, m_tiles=tiles, max_concurrent_steps=steps,
                                          out_slots=slots)), nbytes, ref)
            for tiles, steps, slots in SWIGLU_DEPTHS})
        out.update({f"swiglu_{layout} half t{tiles} s{steps} o{slots}": (
            _mosaic_gpu(functools.partial(fused, m_tiles=tiles, max_concurrent_steps=steps,
                                          out_slots=slots, half_tiles=True)), nbytes, ref)
            for tiles, steps, slots in SWIGLU_HALF_DEPTHS})
    return out


# (m_tiles, max_concurrent_steps, out_slots) of the one-pass SwiGLU quantizers, their
# default first. Each step loads a gate and an up tile (64 KiB of smem), so the default
# (two steps in flight, 144 KiB) leaves one CTA, one warpgroup, per SM to compute silu;
# one step in flight (80 KiB, 96 with two codes slots) lets two CTAs share an SM.
SWIGLU_DEPTHS = ((8, 2, 1), (8, 1, 1), (4, 1, 1), (16, 1, 1), (32, 1, 1), (8, 1, 2))
# The same with ``half_tiles`` (64-row tiles for rows, 64-column ones for columns): a step
# in flight takes 32 KiB, so two or three in flight (74 / 106 KiB with the codes) still
# let two CTAs share an SM (209-211 registers compiled for an H200, against 255 for the
# whole tiles). m_tiles counts the half tiles along M for rows.
SWIGLU_HALF_DEPTHS = ((16, 2, 1), (16, 3, 1), (32, 2, 2))


# (m_tiles, max_concurrent_steps, out_slots) of the Mosaic GPU activation quantizers
# (rows, columns, both) to time, their default first: tile walks of 2 to 64 row tiles
# per CTA (at M = 65536, C = 2048: 4096 to 128 CTAs), smem 48 KiB (s1 o1, one layout)
# up to 160 KiB (s3 o2, both layouts).
COLUMNS_DEPTHS = ((8, 2, 1), (2, 2, 1), (4, 2, 1), (16, 2, 1), (64, 2, 1), (8, 1, 1),
                  (8, 3, 1), (8, 2, 2), (16, 3, 2))


def _mosaic_gpu(fn):
    """fn on a Hopper GPU; elsewhere (``--smoke`` on CPU) under Pallas GPU interpret mode."""
    if mosaic.is_available():
        return fn

    def interpreted(*args):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        with plgpu.force_gpu_interpret_mode():
            return fn(*args)

    return interpreted


def weight_variants(g, k, n):
    """name -> (fn of w [G, K, N], bytes moved, the name whose outputs it must equal or None):
    a bf16 copy of w, the Triton weight kernel with and without the transposed codes,
    and the Mosaic GPU one at each pipeline depth of ``WEIGHT_DEPTHS`` and without them."""
    wn = g * k * n
    one = 2 * wn + wn + 4 * wn // 128**2  # read w once, write one copy of codes and the scales
    out = {"copy": (lambda w: w * 2, 4 * wn, None),
           "triton": (fp8_quant_kernels.quantize_weight, one + wn, None),
           "triton natural": (functools.partial(fp8_quant_kernels.quantize_weight, transposed=False),
                              one, None)}
    for steps, slots in WEIGHT_DEPTHS:
        out[f"mosaic s{steps} o{slots}"] = (
            functools.partial(fp8_quant_mgpu.quantize_weight, max_concurrent_steps=steps,
                              out_slots=slots), one + wn, "triton")
    out["mosaic natural"] = (functools.partial(fp8_quant_mgpu.quantize_weight, transposed=False),
                             one, "triton natural")
    return out


# (max_concurrent_steps, out_slots) of the Mosaic GPU weight quantizer to time, its
# default first: smem 96 KiB (two CTAs per SM) up to 160 KiB.
WEIGHT_DEPTHS = ((2, 1), (1, 1), (1, 2), (2, 2), (3, 1), (3, 2))


def _blocky(rng, shape):
    """bf16 normal values, every 128x128 block (of the last two dims) its own magnitude."""
    *lead, r, c = shape
    scale = np.exp(rng.uniform(-6, 6, (*lead, r // 128, 1, c // 128, 1))).astype(np.float32)
    a = rng.standard_normal(shape, np.float32).reshape(*lead, r // 128, 128, c // 128, 128)
    return jnp.asarray((a * scale).reshape(shape), jnp.bfloat16)


def sweep(shapes, dims, variants_of, iters, record, section):
    """Times ``variants_of(*shape)`` on ``_blocky`` data at each shape of ``shapes`` (its
    dims named ``dims``) into ``record["rows"]``, each against the same run's plain bf16
    copy, outputs checked bit for bit where a variant names another. True if every
    variant ran and all checked outputs are equal."""
    print(f"{'shape':<16} {'variant':<30} {'kernel ms':>10} {'wall ms':>9} {'GB/s kern':>10} "
          f"{'vs copy':>8} {'GB/s wall':>10} {'vs copy':>8}  bits")
    rng = np.random.default_rng(0)
    for shape in shapes:
        a = _blocky(rng, shape)
        label = "x".join(map(str, shape))
        copy = {}
        refs = {}
        for name, (fn, nbytes, same_as) in variants_of(*shape).items():
            f = jax.jit(fn)
            row = {"section": section, **dict(zip(dims, shape)), "name": name, "gbytes": nbytes / 1e9}
            try:
                got = jax.block_until_ready(f(a))
                if same_as is None and name != "copy":
                    refs[name] = got
                elif same_as is not None:
                    row["bitwise_equal_to"] = same_as
                    row["equal"] = all(bool(jnp.array_equal(_bits(x_), _bits(y_)))
                                       for x_, y_ in zip(got, refs[same_as], strict=True))
                del got
                kms = cupti_ms(f, (a,), iters)
                wms = wall_ms(f, (a,), iters)
            except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
                print(f"{label:<16} {name:<30} failed: {type(e).__name__}: {str(e)[:300]}")
                record["rows"].append({**row, "error": str(e)[:1000]})
                continue
            row.update(kernel_ms=kms, wall_ms=wms, gbps_kernel=kms and nbytes / kms / 1e6,
                       gbps_wall=nbytes / wms / 1e6)
            if name == "copy":
                copy = row
            row["vs_copy_kernel"] = (row["gbps_kernel"] / copy["gbps_kernel"]
                                     if row["gbps_kernel"] and copy.get("gbps_kernel") else None)
            row["vs_copy_wall"] = row["gbps_wall"] / copy["gbps_wall"] if copy else None
            record["rows"].append(row)
            nan = float("nan")
            print(f"{label:<16} {name:<30} {kms or nan:>10.3f} {wms:>9.3f} "
                  f"{row['gbps_kernel'] or nan:>10.0f} {row['vs_copy_kernel'] or nan:>8.2f} "
                  f"{row['gbps_wall']:>10.0f} {row['vs_copy_wall'] or nan:>8.2f}  "
                  f"{'' if same_as is None else ('==' if row['equal'] else 'DIFFER from') + ' ' + same_as}")
        refs.clear()
    return all(r.get("equal", True) and "error" not in r for r in record["rows"])


def _shapes(text, rank):
    """"AxB,CxD" -> [(A, B), (C, D)]: ``rank`` dims each, the last two multiples of 128.

    Raises:
      ValueError: anything else.
    """
    shapes = [tuple(int(d) for d in s_.split("x")) for s_ in text.split(",")]
    if any(len(s_) != rank or s_[-2] % 128 or s_[-1] % 128 or 0 in s_ for s_ in shapes):
        raise ValueError(text)
    return shapes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="65536,32,7168,4096", help="M,G,K,N")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    p.add_argument("--smoke", action="store_true", help="tiny shape, passes only (CPU check)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the profiler breakdown")
    p.add_argument("--quick", action="store_true", help="5 iterations, no breakdown")
    p.add_argument("--schedules", default="",
                   help="comma list of kernel schedules (quantized.KERNEL_SCHEDULES) to time "
                        "the default path's fwd+bwd with too, beside the default schedule")
    p.add_argument("--columns-variants", action="store_true",
                   help="only the sweep of the activation quantizers (Pallas warp counts, "
                        "Mosaic GPU tile walks and depths)")
    p.add_argument("--variant-shapes", default="65536x7168,65536x4096,65536x2048",
                   help="the sweep's activation shapes, MxC,... (multiples of 128)")
    p.add_argument("--swiglu-variants", action="store_true",
                   help="only the sweep of the one-pass SwiGLU quantizers (tile walks and "
                        "depths) against XLA's SwiGLU then the Mosaic pass, at --swiglu-shapes")
    p.add_argument("--swiglu-shapes", default="65536x4096",
                   help="that sweep's gu shapes, Mx2F,... (default DeepSeek-V3's F = 2048)")
    p.add_argument("--weight-variants", action="store_true",
                   help="only the sweep of the Triton and Mosaic GPU weight quantizers (GPU)")
    p.add_argument("--weight-shapes", default="32x7168x4096,128x2048x1536,128x768x2048",
                   help="that sweep's weight shapes, GxKxN,... (K, N multiples of 128)")
    a = p.parse_args(argv)
    if a.quick:
        a.iters, a.no_breakdown = min(a.iters, 5), True
    schedules = [s_ for s_ in a.schedules.split(",") if s_]
    if unknown := [s_ for s_ in schedules if s_ not in quantized.KERNEL_SCHEDULES]:
        print(f"error: --schedules {','.join(unknown)}: not in {tuple(quantized.KERNEL_SCHEDULES)}",
              file=sys.stderr)
        return 2
    for flag, kind, dims, variants_of, section, text, smoke_shape in (
            (a.columns_variants, "fp8_quant_columns", ("M", "C"), column_variants,
             "columns_variant", a.variant_shapes, (256, 384)),
            (a.swiglu_variants, "fp8_quant_swiglu", ("M", "C"), swiglu_variants,
             "swiglu_variant", a.swiglu_shapes, (256, 256)),
            (a.weight_variants, "fp8_quant_weight", ("G", "K", "N"), weight_variants,
             "weight_variant", a.weight_shapes, (2, 256, 384))):
        if not flag:
            continue
        try:
            shapes = [smoke_shape] if a.smoke else _shapes(text, len(dims))
        except ValueError:
            print(f"error: shapes {text!r}: want {'x'.join(dims)},... with the last two dims "
                  "positive multiples of 128", file=sys.stderr)
            return 2
        if kind == "fp8_quant_swiglu" and any(s_[-1] % 256 for s_ in shapes):
            print(f"error: --swiglu-shapes {text!r}: gu's columns are [gate | up], 2F with F "
                  "a multiple of 128, so a multiple of 256", file=sys.stderr)
            return 2
        if kind == "fp8_quant_weight" and not mosaic.is_available():
            print("error: --weight-variants needs a Hopper GPU (the Mosaic GPU kernel does not "
                  "run elsewhere outside its tests' interpret mode)", file=sys.stderr)
            return 2
        record = measure.new_record(kind, {"shapes": [list(s_) for s_ in shapes],
                                           "iters": a.iters, "dtype": "bfloat16"})
        equal = sweep(shapes, dims, variants_of, a.iters, record, section)
        print(f"\nrecord: {measure.write_record(record, a.out)}")
        return 0 if equal else 1
    m, g, k, n = (256, 2, 256, 256) if a.smoke else map(int, a.shape.split(","))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    gs = jnp.full((g,), m // g, jnp.int32)
    record = measure.new_record("fp8_quant", {"M": m, "G": g, "K": k, "N": n, "iters": a.iters,
                                              "dtype": "bfloat16", "layout": "balanced",
                                              "schedules": schedules})
    inputs = {"x": x, "w": w}
    print(f"{'pass':<10} {'kernel ms':>10} {'wall ms':>9} {'GB':>7} {'GB/s kern':>10} "
          f"{'GB/s wall':>10}")
    outputs = {}
    for name, (fn, which, nbytes) in passes(m, g, k, n).items():
        f = jax.jit(fn)
        try:
            if name in SAME_AS or name in SAME_AS.values():
                outputs[name] = jax.block_until_ready(f(inputs[which]))
            kms = cupti_ms(f, (inputs[which],), a.iters)
            wms = wall_ms(f, (inputs[which],), a.iters)
        except Exception as e:  # noqa: BLE001 - one pass failing must not lose the others
            print(f"{name:<10} failed: {type(e).__name__}: {str(e)[:300]}")
            record["rows"].append({"section": "pass", "name": name, "error": str(e)[:1000]})
            continue
        row = {"section": "pass", "name": name, "kernel_ms": kms, "wall_ms": wms,
               "gbytes": nbytes / 1e9, "gbps_kernel": kms and nbytes / kms / 1e6,
               "gbps_wall": nbytes / wms / 1e6}
        record["rows"].append(row)
        print(f"{name:<10} {kms or float('nan'):>10.3f} {wms:>9.3f} {nbytes / 1e9:>7.3f} "
              f"{row['gbps_kernel'] or float('nan'):>10.0f} {row['gbps_wall']:>10.0f}")
    for name, base in SAME_AS.items():
        if name not in outputs:
            continue
        same = all(bool(jnp.array_equal(_bits(a_), _bits(b_)))
                   for a_, b_ in zip(outputs[name], outputs[base]))
        record["rows"].append({"section": "check", "name": name, "bitwise_equal_to": base,
                               "equal": same})
        print(f"{name} == {base}: {same}")
    outputs.clear()
    if mosaic.is_available():
        flops = 2 * m * k * n
        print(f"\n{"product":<30} {'kernel ms':>10} {'wall ms':>9} {'TF/s kern':>10} {'TF/s wall':>10}")
        prods = products(x, w, gs, dy, schedules)
        for name, (fn, args) in prods.items():
            fl = flops * (3 if "bwd" in name else 1)
            try:
                kms = cupti_ms(fn, args, a.iters)
                wms = wall_ms(fn, args, a.iters)
            except Exception as e:  # noqa: BLE001
                print(f"{name:<30} failed: {type(e).__name__}: {str(e)[:300]}")
                record["rows"].append({"section": "product", "name": name, "error": str(e)[:1000]})
                continue
            record["rows"].append({"section": "product", "name": name, "kernel_ms": kms,
                                   "wall_ms": wms, "tflops_kernel": kms and fl / kms / 1e9,
                                   "tflops_wall": fl / wms / 1e9})
            print(f"{name:<30} {kms or float('nan'):>10.3f} {wms:>9.3f} "
                  f"{(kms and fl / kms / 1e9) or float('nan'):>10.0f} {fl / wms / 1e9:>10.0f}")
        # x's codes kept from the forward against x quantized again in the backward:
        # y, dx and dw bit for bit.
        name, base = "fwd+bwd kernel path, auto q, x quantized twice", "fwd+bwd kernel path, auto q"
        got, want = ((jax.block_until_ready(prods[n_][0](*prods[n_][1]))) for n_ in (name, base))
        same = all(bool(jnp.array_equal(_bits(u), _bits(v))) for u, v in zip(got, want))
        record["rows"].append({"section": "check", "name": name, "bitwise_equal_to": base,
                               "equal": same})
        print(f"{name} == {base}: {same}")
        path = measure.write_record(record, a.out)  # kept if the breakdown fails
    if mosaic.is_available() and not a.no_breakdown:
        fn, args = products(x, w, gs, dy)["fwd+bwd kernel path, auto q"]
        bd = measure.profile_calls(fn, *args, calls=3)
        record["breakdown_fwd_bwd_kernel_path"] = bd.to_dict()
        record["breakdown_quant_impl"] = "auto"
        print("\nfwd+bwd kernel path (auto quantizers), kernels by time (3 calls):")
        for kr in bd.top_kernels:
            print(f"  {kr['time_us'] / 3 / 1e3:8.3f} ms  x{kr['count'] // 3:<3} {kr['name'][:90]}")
    elif not mosaic.is_available():
        print("(no Hopper GPU: product rows and breakdown skipped)")
    path = measure.write_record(record, a.out)
    print(f"\nrecord: {path}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
