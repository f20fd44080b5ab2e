"""Grouped GEMM benchmark: fwd, dgrad, wgrad and fwd+dgrad+wgrad TF/s on one GPU.

Legend: M rows, K x N the weight dims (w[G, K, N]), G groups.

Compares, in one process and on the same random data:
  ours    the ``mosaic`` backend (dropless.ops.gmm.mosaic)
  dense   cuBLAS through XLA (jnp.dot / dot_general) at equal FLOPs: the ceiling
  torch   ``torch._grouped_mm`` (CUTLASS), timed with CUDA events
  jaxex   jax's example kernels ragged_dot_mgpu / transposed_ragged_dot_mgpu
  ragged  ``jax.lax.ragged_dot`` (the xla backend), a few iterations only

With ``--quant mxfp8|blockwise`` two more columns (FP8 recipes, issue 8):
  ours_q  ``ops.gmm.quantized`` with that recipe over the mosaic backend: the
          quantize-dequantize of the operands plus our bf16 kernel, all timed
          (what a training step pays today; the FP8 Mosaic kernel would
          replace it)
  dense8  an FP8 x FP8 -> bf16 dense product through XLA (cuBLASLt FP8 GEMM,
          E4M3 operands quantized outside the timing) at equal FLOPs: the
          FP8 ceiling, next to ``dense`` (the bf16 one)
and with ``--quant blockwise`` two more, the FP8 Mosaic kernels
(``quantized.gmm(impl="kernel")``, ``mosaic_fp8`` / ``mosaic_fp8_tgmm``):
  ours_fp8k  each product quantized in its kernel's layout by the quantizers
             training uses (``quant_impl="auto"``, groups aligned as the MoE
             block pads them), then the kernel, all timed (what a training step
             with ``gmm_fp8_impl: kernel`` pays, but for dgrad, which in
             training reuses the forward's weight codes; compare with ours_q)
  fp8k       the kernels alone on codes and scales prepared outside the
             timing (compare with dense8)

FLOPs count real rows only: 2 * sum(group_sizes) * K * N per product. JAX
timings are kernel time on device through CUPTI
(``jax.experimental.mosaic.gpu.profiler.measure``), median of ``--iters``
runs after a warm-up; torch uses ``triton.testing.do_bench`` (median). Each
row records the GPU's SM clock, power and throttle reasons over its timings
(``gpu_clocks``, ``perf.clocks``): a sustained training step runs at the board's
power limit, below the rated clock; a short kernel timing may run faster.

Run on the GPU machine (one command):
  PYTHONPATH=src python3 benchmarks/gmm.py [--quick] [--tune] [--out DIR] [--commit SHA]
  PYTHONPATH=src python3 benchmarks/gmm.py --shape-set qwen3-30b   # Qwen3-30B-A3B's expert GEMMs
``--tune`` first sweeps tile configs on the G=32 shapes (or on all of a
``--shape-set`` without any), writes ``tuning_<gpu>.json`` (to --out and into
the package; entries of other shapes are kept) and benchmarks with it;
a normal run only reads the checked-in table. ``--smoke`` runs tiny shapes in
Pallas GPU interpret mode on CPU, to check this script without a GPU.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from dropless.ops.gmm import api, mosaic, tuning, xla  # noqa: E402
from dropless.perf import measure  # noqa: E402
from dropless.perf.clocks import ClockSampler, format_summary  # noqa: E402
from dropless.perf.provenance import source_digest  # noqa: E402

# Shapes (M, G, K, N): the expert GEMMs of the presets, read through the CLI's
# loader when a set is chosen. M = 65536 rows (8192 tokens x top-8), gate|up
# fused [D, 2F] and down [F, D]; their dgrads are the transposed problems, so
# K or N = F appears in every direction.
def preset_expert_shapes(model_name: str, rows: int = 65536, ep: int = 1) -> list[tuple[int, int, int, int]]:
    """(M, G, K, N) of a preset's two expert GEMMs, gate|up [D, 2F] and down [F, D], on
    one device of expert parallelism ``ep`` (G = num_experts / ep)."""
    d, f, e = _expert_dims(model_name)
    g = e // ep
    return [(rows, g, d, 2 * f), (rows, g, f, d)]


@functools.cache
def _expert_dims(model_name: str) -> tuple[int, int, int]:
    """(D, F, E) of a preset, loaded once per preset (``deepseek_shapes`` asks three times)."""
    from dropless.config.loader import load_config

    cfg = load_config(None, [f"model_name={model_name}"], environ={}).config
    return cfg.emb_dim, cfg.moe_mlp_dim, cfg.num_experts


def deepseek_shapes() -> list[tuple[int, int, int, int]]:
    """DeepSeek-V3's expert GEMMs (D=7168, F=2048, 256 experts) at expert parallelism
    8 (G=32), 1 (G=256) and 32 (G=8, a quarter of the rows); most important first,
    in case a run is cut short (``--quick``: the first 3)."""
    wi_32, wo_32 = preset_expert_shapes("deepseek3-671b", ep=8)
    wi_256, wo_256 = preset_expert_shapes("deepseek3-671b")
    wi_8, _ = preset_expert_shapes("deepseek3-671b", rows=16384, ep=32)
    return [wi_32, wo_32, wi_256, wi_8, wo_256]


SHAPE_SETS = {  # name -> its shapes, built when chosen
    "deepseek": deepseek_shapes,
    "qwen3-30b": functools.partial(preset_expert_shapes, "qwen3-30b-a3b"),  # D=2048, F=768
    "qwen3-235b": functools.partial(preset_expert_shapes, "qwen3-235b-a22b"),  # D=4096, F=1536
    "mixtral-8x7b": functools.partial(preset_expert_shapes, "mixtral-8x7b"),  # D=4096, F=14336, G=8
}


def shape_set(name: str) -> list[tuple[int, int, int, int]]:
    return SHAPE_SETS[name]()


SMOKE_SHAPES = [(300, 5, 128, 256)]
SMOKE_SHAPES_FP8 = [(300, 3, 256, 256)]  # the FP8 kernels need K and N multiples of 256
LAYOUTS = ["balanced", "dirichlet1.0", "dirichlet0.3", "empty"]
OPS = ["fwd", "dgrad", "wgrad", "fwd+dgrad+wgrad"]
IMPLS = ["ours", "dense", "torch", "jaxex", "ragged"]
# Timed by wall clock too (``wall_clock_ms``), beside CUPTI's kernel time: what a step
# pays. torch's do_bench is already a timing of whole calls (CUDA events).
WALL_IMPLS = ("ours", "dense")
QUANT_RECIPES = {"mxfp8": "te_mxfp8", "blockwise": "te_fp8_blockwise"}


def make_group_sizes(layout, m, g, seed=0):
    """Group sizes summing to m: balanced, Dirichlet-skewed, or every 4th group empty."""
    rng = np.random.default_rng(seed)
    if layout == "balanced":
        p = np.full(g, 1.0 / g)
    elif layout.startswith("dirichlet"):
        p = rng.dirichlet(np.full(g, float(layout[len("dirichlet"):])))
    elif layout == "empty":
        p = np.where(np.arange(g) % 4 == 3, 0.0, 1.0)
        p /= p.sum()
    else:
        raise ValueError(f"unknown layout {layout!r}")
    sizes = np.floor(p * m).astype(np.int64)
    sizes[np.argmax(p)] += m - sizes.sum()
    return sizes.astype(np.int32)


def align_group_sizes(sizes, align):
    """Each size rounded down to a multiple of ``align``; the rows taken off go to the
    largest group, rounded down too (the total stays <= M and a multiple of align)."""
    out = sizes // align * align
    big = int(np.argmax(sizes))
    out[big] += (int(sizes.sum()) - int(out.sum())) // align * align
    return out.astype(np.int32)


def quantized_alignment(quant):
    from dropless.ops.gmm import quantized

    return quantized.required_alignment(QUANT_RECIPES[quant])


def time_jax(fn, args, iters):
    """Median device kernel time (ms) of fn(*args) over iters runs, after a warm-up."""
    jax.block_until_ready(fn(*args))
    try:  # in chunks: at G=256 ten iterations' outputs alone would not fit
        return statistics.median(measure.cupti_kernel_ms(fn, *args, iters=iters)), "cupti"
    except Exception:  # CUPTI unavailable: synchronized wall clock per call
        return wall_clock_ms(fn, args, iters), "wallclock"


def wall_clock_ms(fn, args, iters):
    """Median wall-clock time (ms) of one jitted call of fn(*args), each waited for
    (``block_until_ready``), back to back after a warm-up: what a step pays for the
    call, launch gaps and any schedule or layout kernels included."""
    return measure.time_fn(fn, *args, warmup=1, iters=iters, reps=1)["median_ms"]


def time_torch(fn, iters):
    import triton.testing

    fn()
    return triton.testing.do_bench(fn, warmup=5 * iters, rep=20 * iters, return_mode="median")


@jax.jit
def _sq_norms(a, b):
    # Upcast inside one fusion: no float32 copy of a [G, K, N] gradient.
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    return jnp.sum((a - b) ** 2), jnp.sum(b**2)


def rel_err(a, b):
    diff, ref = _sq_norms(a, b)
    return float(jnp.sqrt(diff / jnp.maximum(ref, 1e-30)))


def _jaxlib_version():
    import jaxlib

    return jaxlib.__version__


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def torch_fns(x, w, dy, sizes):
    """Closures running torch._grouped_mm fwd / dgrad / wgrad on the same buffers.

    Each op takes the first operand layout torch accepts: views of the JAX
    buffers first, else a copy in the layout CUTLASS wants, made once here
    (outside the timing) and noted in ``notes``.
    """
    torch = _torch()
    if torch is None:
        return None
    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
    col_major = lambda t: t.transpose(-2, -1).contiguous().transpose(-2, -1)
    candidates = {
        "fwd": [("w as is", lambda: (tx, tw)), ("w column-major copy", lambda: (tx, col_major(tw)))],
        "dgrad": [("w^T view", lambda: (tdy, tw.transpose(-2, -1))),
                  ("w^T row-major copy", lambda: (tdy, tw.transpose(-2, -1).contiguous()))],
        "wgrad": [("x^T view", lambda: (tx.t(), tdy)), ("x^T row-major copy", lambda: (tx.t().contiguous(), tdy))],
    }
    fns, notes = {}, {}
    for op, cands in candidates.items():
        for note, make in cands:
            try:
                a, b = make()
                torch._grouped_mm(a, b, offs=offs)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                notes[op] = f"{note}: {type(e).__name__} {str(e)[:120]}"
                continue
            fns[op] = lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs)
            notes[op] = note
            break

    def all3():
        for op in ("fwd", "dgrad", "wgrad"):
            fns[op]()

    if len(fns) == 3:
        fns["fwd+dgrad+wgrad"] = all3
    fns["notes"] = notes
    return fns


def quant_fns(impl, g, recipe):
    """{op: fn(x, w, dy, gs)} of the FP8 columns; ``dense8`` takes E4M3 x, w, dy."""
    from dropless.ops.gmm import quantized

    if impl == "ours_q":
        q = functools.partial(quantized.qdq, recipe=recipe)
        fwd = lambda x, w, dy, gs: quantized.gmm(x, w, gs, recipe=recipe, backend="mosaic",
                                                 impl="emulate")
        dgrad = lambda x, w, dy, gs: mosaic.gmm(q(dy, axis=1), q(w, axis=2), gs, transpose_rhs=True)
        wgrad = lambda x, w, dy, gs: mosaic.tgmm(q(x, axis=0), q(dy, axis=0), gs, num_groups=g)

        def all3(x, w, dy, gs):
            y, vjp = jax.vjp(lambda x, w: quantized.gmm(x, w, gs, recipe=recipe, backend="mosaic",
                                                        impl="emulate"), x, w)
            return y, *vjp(dy)
    elif impl == "dense8":
        def dot(a, b, dims):
            return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.bfloat16)

        fwd = lambda x, w, dy, gs: dot(x, w[0], ((1,), (0,)))
        dgrad = lambda x, w, dy, gs: dot(dy, w[0], ((1,), (1,)))
        wgrad = lambda x, w, dy, gs: dot(x, dy, ((0,), (0,)))

        def all3(x, w, dy, gs):
            return fwd(x, w, dy, gs), dgrad(x, w, dy, gs), wgrad(x, w, dy, gs)
    elif impl == "ours_fp8k":
        # What training runs: the quantizers ``auto`` picks (``quantized.quantizer``) and
        # groups aligned to whole scale blocks, as the MoE block pads them (``bench_shape``
        # aligns the sizes), so wgrad reads dy and x without regrouping them. (Until
        # 2026-12-03 this column used the XLA quantizers and regrouped the rows: at G=256
        # XLA's weight quantization materialized a float32 copy of the 15 GB weight.)
        fwd = lambda x, w, dy, gs: quantized.kernel_fwd(x, w, gs, x.dtype, quant_impl="auto")
        dgrad = lambda x, w, dy, gs: quantized.kernel_dgrad(dy, w, gs, x.dtype, quant_impl="auto")
        wgrad = lambda x, w, dy, gs: quantized.kernel_wgrad(x, dy, gs, w.dtype, aligned=True,
                                                            quant_impl="auto")

        def all3(x, w, dy, gs):
            y, vjp = jax.vjp(lambda x, w: quantized.gmm(x, w, gs, recipe=recipe, impl="kernel",
                                                        groups_aligned=True), x, w)
            return y, *vjp(dy)
    else:
        raise ValueError(impl)
    fns = {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, "fwd+dgrad+wgrad": all3}
    return {op: jax.jit(f) for op, f in fns.items()}


def fp8_kernel_fns(x, w, dy):
    """({op: jitted fn(operands, gs)}, operands): the FP8 kernels alone, on codes and
    scales made once here (outside any timing), rows padded as ``quantized`` pads them."""
    from dropless.ops.gmm import mosaic_fp8, mosaic_fp8_tgmm, quantized

    xp, dyp = quantized.pad_kernel_rows(x), quantized.pad_kernel_rows(dy)

    @jax.jit
    def prepare(xp, w, dyp):
        wq, sw = mosaic_fp8.quantize_weight(w)
        return (mosaic_fp8.fwd_operands(xp, wq, sw), mosaic_fp8.dgrad_operands(dyp, wq, sw),
                mosaic_fp8_tgmm.wgrad_operands(xp, dyp))

    fwd = lambda ops, gs: mosaic_fp8.gmm_fp8_blockwise(*ops[0], gs, out_dtype=x.dtype)
    dgrad = lambda ops, gs: mosaic_fp8.gmm_fp8_blockwise(*ops[1], gs, out_dtype=x.dtype)
    wgrad = lambda ops, gs: mosaic_fp8_tgmm.tgmm_fp8_blockwise(*ops[2], gs, out_dtype=w.dtype)
    all3 = lambda ops, gs: (fwd(ops, gs), dgrad(ops, gs), wgrad(ops, gs))
    fns = {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, "fwd+dgrad+wgrad": all3}
    return {op: jax.jit(f) for op, f in fns.items()}, jax.block_until_ready(prepare(xp, w, dyp))


def jax_fns(impl, g, tilings, jaxex_cfg):
    """{op: jitted fn(x, w, dy, gs)} for one implementation."""
    if impl == "ours":
        t = tilings
        fwd = lambda x, w, dy, gs: mosaic.gmm(x, w, gs, tiling=t.get("fwd"))
        dgrad = lambda x, w, dy, gs: mosaic.gmm(dy, w, gs, transpose_rhs=True, tiling=t.get("dgrad"))
        wgrad = lambda x, w, dy, gs: mosaic.tgmm(x, dy, gs, num_groups=g, tiling=t.get("wgrad"))

        def all3(x, w, dy, gs):
            y, vjp = jax.vjp(lambda x, w: api.gmm(x, w, gs, backend="mosaic"), x, w)
            return y, *vjp(dy)
    elif impl == "ragged":
        fwd = lambda x, w, dy, gs: xla.gmm(x, w, gs)
        dgrad = lambda x, w, dy, gs: xla.gmm(dy, w, gs, transpose_rhs=True)
        wgrad = lambda x, w, dy, gs: xla.tgmm(x, dy, gs, num_groups=g)

        def all3(x, w, dy, gs):
            y, vjp = jax.vjp(lambda x, w: api.gmm(x, w, gs, backend="xla"), x, w)
            return y, *vjp(dy)
    elif impl == "jaxex":
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

        fwd = lambda x, w, dy, gs: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, **jaxex_cfg["gmm"])
        dgrad = lambda x, w, dy, gs: ragged_dot_mgpu.ragged_dot(
            dy, w, group_sizes=gs, transpose_rhs=True, **jaxex_cfg["gmm"]
        )
        wgrad = lambda x, w, dy, gs: transposed_ragged_dot_mgpu.transposed_ragged_dot(
            x, dy, group_sizes=gs, **jaxex_cfg["tgmm"]
        )

        def all3(x, w, dy, gs):
            return fwd(x, w, dy, gs), dgrad(x, w, dy, gs), wgrad(x, w, dy, gs)
    elif impl == "dense":
        fwd = lambda x, w, dy, gs: jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(x.dtype)
        dgrad = lambda x, w, dy, gs: lax.dot_general(
            dy, w[0], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ).astype(x.dtype)
        wgrad = lambda x, w, dy, gs: lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        ).astype(x.dtype)

        def all3(x, w, dy, gs):
            return fwd(x, w, dy, gs), dgrad(x, w, dy, gs), wgrad(x, w, dy, gs)
    else:
        raise ValueError(impl)
    fns = {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, "fwd+dgrad+wgrad": all3}
    return {op: jax.jit(f) for op, f in fns.items()}


def random_inputs(m, g, k, n, seed):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
    return jax.block_until_ready((x, w, dy))


def check_ours(fns_ours, torch_f, x, w, dy, gs):
    """Relative error of ours vs torch._grouped_mm (an independent implementation)."""
    errs = {}
    if torch_f is None:
        return errs
    import torch

    for op in ("fwd", "dgrad", "wgrad"):
        if op not in torch_f:
            continue
        ours = fns_ours[op](x, w, dy, gs)
        ref = jnp.from_dlpack(torch_f[op]().contiguous())
        torch.cuda.synchronize()
        errs[op] = rel_err(ours, ref)
    return errs


def bench_quant(row, x, w, dy, gs, g, flops, args, dense8_ms):
    """The ``--quant`` columns of one row: ours_q (all of it timed) and dense8 (FP8 GEMM only)."""
    recipe = QUANT_RECIPES[args.quant]
    row["quant"] = recipe
    fns = quant_fns("ours_q", g, recipe)
    for op in OPS:
        _run(row, "ours_q", op, flops, lambda op=op: time_jax(fns[op], (x, w, dy, gs), args.iters))
    # The recipe's error next to bf16 (about 5% for FP8 operands, whatever the size).
    row["rel_err_q_vs_bf16"] = _safe(
        lambda: rel_err(fns["fwd"](x, w, dy, gs), mosaic.gmm(x, w, gs)), None)
    if recipe == "te_fp8_blockwise":
        _safe(lambda: bench_fp8_kernels(row, x, w, dy, gs, g, flops, args, fns), None)
    if not dense8_ms:
        f8 = tuple(a.astype(jnp.float8_e4m3fn) for a in (x, w[:1], dy))
        fns8 = quant_fns("dense8", g, recipe)
        for op in OPS:
            _run(row, "dense8", op, flops,
                 lambda op=op: time_jax(fns8[op], (*f8, gs), args.iters))
        dense8_ms.update(row["ms"].get("dense8", {}))
        del f8
    else:
        for op, ms in dense8_ms.items():
            row["ms"].setdefault("dense8", {})[op] = ms
            row["tflops"].setdefault("dense8", {})[op] = (3 if "+" in op else 1) * flops / ms / 1e9


def bench_fp8_kernels(row, x, w, dy, gs, g, flops, args, fns_q):
    """The blockwise FP8 kernel columns: ours_fp8k (quantize + kernel) and fp8k (kernel only),
    and each product's relative difference from the emulation (the same FP8 products summed
    in another order, then rounded to bf16: about 1e-3 at most; near the recipe's error,
    ~4e-2, it is a kernel bug)."""
    fns = quant_fns("ours_fp8k", g, QUANT_RECIPES[args.quant])
    for op in OPS:
        _run(row, "ours_fp8k", op, flops, lambda op=op: time_jax(fns[op], (x, w, dy, gs), args.iters))
    row["rel_err_fp8k_vs_q"] = {
        op: _safe(lambda op=op: rel_err(fns[op](x, w, dy, gs), fns_q[op](x, w, dy, gs)), None)
        for op in ("fwd", "dgrad", "wgrad")}
    kfns, ops = fp8_kernel_fns(x, w, dy)
    for op in OPS:
        _run(row, "fp8k", op, flops, lambda op=op: time_jax(kfns[op], (ops, gs), args.iters))
    del ops


def bench_shape(m, g, k, n, layouts, impls, tilings, args, record, save=lambda: None,
                clocks=None):
    """Time every impl on one shape, a row per layout; ``save()`` after each row, so a
    run cut off by its limit keeps the rows it finished. Each row has the GPU's clocks
    over its timings (``gpu_clocks``, ``perf.clocks``; ``clocks``: an entered sampler,
    default a fresh ``ClockSampler``)."""
    if clocks is None:
        with ClockSampler() as sampler:
            return bench_shape(m, g, k, n, layouts, impls, tilings, args, record, save, sampler)
    x, w, dy = random_inputs(m, g, k, n, seed=m + g + k + n)
    dense_ms, dense_wall_ms, dense8_ms = {}, {}, {}
    for layout in layouts:
        clocks.reset()  # a row's window holds its own samples only
        clocks.start(layout)
        sizes = make_group_sizes(layout, m, g, seed=g)
        if args.quant != "none":  # as the MoE block pads them: whole scale blocks per group
            sizes = align_group_sizes(sizes, quantized_alignment(args.quant))
        gs = jnp.asarray(sizes)
        total = int(sizes.sum())
        flops = 2.0 * total * k * n
        row = {"M": m, "G": g, "K": k, "N": n, "layout": layout, "total_rows": total,
               "min_group": int(sizes.min()), "max_group": int(sizes.max()), "ms": {}, "tflops": {}}
        torch_f = torch_fns(x, w, dy, sizes) if "torch" in impls else None
        for impl in impls:
            if impl == "torch":
                if torch_f is None:
                    continue
                row["torch_operands"] = torch_f["notes"]
                for op in OPS:
                    if op in torch_f:
                        _run(row, impl, op, flops, lambda op=op: (time_torch(torch_f[op], args.iters), "events"))
                continue
            if impl == "ragged" and not (layout == layouts[0] and g <= 32):
                continue  # XLA expands ragged_dot to G dense products: slow, one layout suffices
            if impl == "jaxex" and g > 32:
                continue  # its group lookup is unrolled over G: long compiles
            if impl == "dense" and dense_ms:
                for key, per_op in (("ms", dense_ms), ("wall_ms", dense_wall_ms)):
                    for op, ms in per_op.items():
                        _store(row, key, impl, op, flops, ms)
                continue
            fns = jax_fns(impl, g, tilings, JAXEX_CFG)
            iters = 3 if impl == "ragged" else args.iters
            for op in OPS:
                _run(row, impl, op, flops, lambda op=op: time_jax(fns[op], (x, w, dy, gs), iters))
                if impl in WALL_IMPLS:
                    _safe(lambda op=op: _store(row, "wall_ms", impl, op, flops,
                                               wall_clock_ms(fns[op], (x, w, dy, gs), iters)), None)
            if impl == "dense":
                dense_ms.update(row["ms"].get("dense", {}))
                dense_wall_ms.update(row.get("wall_ms", {}).get("dense", {}))
            if impl == "ours":
                row["rel_err_vs_torch"] = _safe(lambda: check_ours(fns, torch_f, x, w, dy, gs), {})
        if args.quant != "none":
            try:
                bench_quant(row, x, w, dy, gs, g, flops, args, dense8_ms)
            except Exception:  # noqa: BLE001 - keep the bf16 numbers of this row
                traceback.print_exc()
        clocks.stop(layout)
        row["gpu_clocks"] = clocks.summary(layout)
        record["results"].append(row)
        save()
        print_row(row)
        sys.stdout.flush()
        del torch_f
        if "torch" in impls and _torch() is not None:
            _torch().cuda.empty_cache()  # give JAX the memory torch's cache holds


def _safe(f, default):
    try:
        return f()
    except Exception as e:  # noqa: BLE001
        print("  error:", type(e).__name__, str(e)[:300])
        return default


def _store(row, key, impl, op, flops, ms):
    """row[key][impl][op] = ms, and its TF/s under key's tflops name (``ms`` ->
    ``tflops``, ``wall_ms`` -> ``wall_tflops``)."""
    row.setdefault(key, {}).setdefault(impl, {})[op] = ms
    tf_key = key.replace("ms", "tflops")
    row.setdefault(tf_key, {}).setdefault(impl, {})[op] = (3 if "+" in op else 1) * flops / ms / 1e9


def _run(row, impl, op, flops, timed):
    try:
        ms, method = timed()
    except Exception as e:  # noqa: BLE001 - OOM and unsupported configs are results too
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        row.setdefault("errors", {})[f"{impl}/{op}"] = ("OOM: " if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower() else "") + msg
        return
    _store(row, "ms", impl, op, flops, ms)
    row.setdefault("timing", {})[impl] = method


def print_row(row):
    t = row["tflops"]
    head = f"M={row['M']} G={row['G']} K={row['K']} N={row['N']} {row['layout']} (groups {row['min_group']}..{row['max_group']})"
    print(head)
    print(f"  {'op':16s}" + "".join(f"{i:>8s}" for i in IMPLS) + f"{'o/dense':>9s}{'o/torch':>9s}")
    for op in OPS:
        vals = [t.get(i, {}).get(op) for i in IMPLS]
        ours, dense, torch_v = (t.get(i, {}).get(op) for i in ("ours", "dense", "torch"))
        r1 = f"{ours / dense:9.3f}" if ours and dense else f"{'-':>9s}"
        r2 = f"{ours / torch_v:9.3f}" if ours and torch_v else f"{'-':>9s}"
        print(f"  {op:16s}" + "".join(f"{v:8.1f}" if v else f"{'-':>8s}" for v in vals) + r1 + r2)
    wall = row.get("wall_tflops", {})
    if wall.get("ours"):
        print("  wall-clock TF/s (ours, dense; ours/torch): " + " | ".join(
            f"{op} {wall['ours'][op]:.0f}, {wall.get('dense', {}).get(op, 0):.0f}"
            + (f"; {wall['ours'][op] / t['torch'][op]:.3f}" if t.get("torch", {}).get(op) else "")
            for op in OPS if wall["ours"].get(op)))
    if row.get("quant"):
        q, o, d8 = (t.get(i, {}) for i in ("ours_q", "ours", "dense8"))
        print(f"  {row['quant']}: " + "  ".join(
            f"{op} {q[op]:.0f} TF/s (x{q[op] / o[op]:.2f} ours bf16"
            + (f", x{q[op] / d8[op]:.2f} dense fp8)" if d8.get(op) else ")")
            for op in OPS if q.get(op) and o.get(op)))
        if row.get("rel_err_q_vs_bf16") is not None:
            print(f"  {row['quant']} fwd rel err vs bf16: {row['rel_err_q_vs_bf16']:.2e}")
        for impl in ("ours_fp8k", "fp8k"):
            k8 = t.get(impl, {})
            if k8:
                print(f"  {impl}: " + "  ".join(
                    f"{op} {k8[op]:.0f} TF/s (x{k8[op] / o[op]:.2f} ours bf16"
                    + (f", x{k8[op] / d8[op]:.2f} dense fp8)" if d8.get(op) else ")")
                    for op in OPS if k8.get(op) and o.get(op)))
        if row.get("rel_err_fp8k_vs_q"):
            print("  fp8 kernel rel diff vs emulation:",
                  {op: f"{v:.1e}" if v is not None else "-" for op, v in row["rel_err_fp8k_vs_q"].items()})
    if row.get("rel_err_vs_torch"):
        print("  rel err vs torch:", {k: f"{v:.2e}" for k, v in row["rel_err_vs_torch"].items()})
    if row.get("errors"):
        print("  errors:", row["errors"])
    if row.get("gpu_clocks"):
        print("  GPU over the row's timings:", format_summary(row["gpu_clocks"]))


JAXEX_CFG = {
    "gmm": dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
    "tgmm": dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
}

TUNE_CANDIDATES = {
    "fwd": [tuning.GmmTiling(), tuning.GmmTiling(grid_tile_width=8), tuning.GmmTiling(num_stages=3),
            tuning.GmmTiling(grid_tile_width=8, chain=True)],
    "wgrad": [tuning.TgmmTiling(), tuning.TgmmTiling(num_stages=3),
              tuning.TgmmTiling(block_k=64, block_n=256), tuning.TgmmTiling(chain=True)],
}
TUNE_CANDIDATES["dgrad"] = TUNE_CANDIDATES["fwd"]


def tune(shapes, args, record):
    """Sweep TUNE_CANDIDATES on balanced G=32 problems; write the tuning table."""
    gpu = tuning.gpu_name()
    entries = []
    for m, g, k, n in shapes:
        x, w, dy = random_inputs(m, g, k, n, seed=1)
        gs = jnp.asarray(make_group_sizes("balanced", m, g))
        flops = 2.0 * m * k * n
        for kind, cands in TUNE_CANDIDATES.items():
            best = None
            for tiling in cands:
                if not tuning.fits(tiling, kind, k, n):
                    continue
                fn = jax.jit({
                    "fwd": lambda x, w, dy, gs, t=tiling: mosaic.gmm(x, w, gs, tiling=t),
                    "dgrad": lambda x, w, dy, gs, t=tiling: mosaic.gmm(dy, w, gs, transpose_rhs=True, tiling=t),
                    "wgrad": lambda x, w, dy, gs, t=tiling: mosaic.tgmm(x, dy, gs, num_groups=g, tiling=t),
                }[kind])
                try:
                    ms, _ = time_jax(fn, (x, w, dy, gs), args.iters)
                except Exception as e:  # noqa: BLE001
                    print(f"  tune {kind} K={k} N={n} {tiling}: {type(e).__name__} {str(e)[:150]}")
                    continue
                tf = flops / ms / 1e9
                print(f"  tune {kind} K={k} N={n} {tiling}: {tf:.1f} TF/s")
                record["tuning_sweep"].append({"kind": kind, "k": k, "n": n, "tiling": dataclasses.asdict(tiling), "tflops": tf})
                if best is None or tf > best[1]:
                    best = (tiling, tf)
            if best:
                entries.append({"dtype": "bfloat16", "kind": kind, "k": k, "n": n,
                                "tiling": dataclasses.asdict(best[0]), "tflops": round(best[1], 1),
                                "measured": f"M={m} G={g} balanced"})
        del x, w, dy
    pkg_path = pathlib.Path(tuning.__file__).parent / f"tuning_{gpu}.json"
    # Entries of shapes not swept now are kept: tuning one shape set (e.g.
    # --shape-set qwen3-30b) must not drop the tiles measured for another.
    key = lambda e: (e["dtype"], e["kind"], e["k"], e["n"])
    swept = {key(e) for e in entries}
    if pkg_path.exists():
        kept = [e for e in json.loads(pkg_path.read_text())["entries"] if key(e) not in swept]
        entries = kept + entries
    table = {"gpu": gpu, "written_by": "benchmarks/gmm.py --tune",
             "date": datetime.date.today().isoformat(), "entries": entries}
    text = json.dumps(table, indent=1) + "\n"
    pkg_path.write_text(text)
    pathlib.Path(args.out, f"tuning_{gpu}.json").write_text(text)
    tuning.load_table.cache_clear()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 shapes, balanced + dirichlet0.3")
    p.add_argument("--tune", action="store_true", help="sweep tile configs first and write the table")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in GPU interpret mode (CPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--quant", default="none", choices=["none", *QUANT_RECIPES],
                   help="also time an FP8 recipe (ours_q) and the dense FP8 GEMM (dense8)")
    p.add_argument("--shapes", default="", help="comma list of indices into the shape set (deepseek unless --shape-set)")
    p.add_argument("--shape-set", default="", choices=["", *SHAPE_SETS],
                   help="a named set of shapes instead of deepseek (qwen3-30b: the 30B's expert GEMMs; mixtral-8x7b: the 8x7B's)")
    p.add_argument("--shape", action="append", default=[], help="M,G,K,N (repeatable)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--commit", default="",
                   help="the commit measured (default: $DROPLESS_COMMIT, else git's HEAD)")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting children after this")
    p.add_argument("--inner", default="", help=argparse.SUPPRESS)  # child: write record here
    p.add_argument("--tune-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.commit:
        from dropless.perf.measure import commit_label

        args.commit = commit_label()
    impls = args.impls.split(",")
    if args.shape:
        shapes = [tuple(int(v) for v in spec.split(",")) for spec in args.shape]
    else:
        shapes = shape_set(args.shape_set or "deepseek")
        shapes = shapes[:3] if args.quick and not args.shape_set else shapes
        if args.shapes:
            shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    layouts = ["balanced", "dirichlet0.3"] if args.quick else LAYOUTS
    dev = jax.devices()[0]
    torch = _torch()
    record = {
        "benchmark": "gmm", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": dev.device_kind, "num_sms": getattr(dev, "core_count", None),
        "jax": jax.__version__, "jaxlib": _jaxlib_version(),
        "torch": getattr(torch, "__version__", None), "commit": args.commit,
        "source_digest": source_digest(),
        "shape_set": args.shape_set or ("custom" if args.shape else "deepseek"),
        "shape_selection": args.shapes or None,  # --shapes: a subset of the set
        "dtype": "bfloat16", "iters": args.iters, "quick": args.quick,
        "timing": "jax: CUPTI kernel time (profiler.measure), median; torch: do_bench median",
        "flops": "2 * sum(group_sizes) * K * N per product; x3 for fwd+dgrad+wgrad",
        "jaxex_config": JAXEX_CFG, "quant": QUANT_RECIPES.get(args.quant, "none"),
        "tuning_sweep": [], "results": [],
    }
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.set_gpu_interpret_mode()
        shapes = shapes if args.shape else (SMOKE_SHAPES_FP8 if args.quant == "blockwise"
                                            else SMOKE_SHAPES)
        layouts, impls = ["dirichlet0.3"], ["ours", "dense"]
        args.tune = False  # a CPU tuning table would be meaningless
        # One timed call per op: the smoke run checks the script, not speed, and Pallas's
        # GPU interpreter has hung on a 2-core machine after a few dozen kernel calls.
        args.iters = 1
    if not args.inner:
        return run_children(args, shapes, record)
    if args.tune:
        tune([s for s in shapes if s[1] == 32] or shapes, args, record)
    path = pathlib.Path(args.inner or pathlib.Path(args.out, _result_name(args.quant)))
    save = lambda: path.write_text(json.dumps(record, indent=1) + "\n")
    if not args.tune_only:
        for m, g, k, n in shapes:
            tilings = {kind: tuning.lookup(kind, jnp.bfloat16, k, n) for kind in tuning.KINDS}
            record.setdefault("tilings", {})[f"K={k},N={n}"] = {
                kk: dataclasses.asdict(v) for kk, v in tilings.items()
            }
            try:
                bench_shape(m, g, k, n, layouts, impls, tilings, args, record, save)
            except Exception:  # noqa: BLE001 - keep the other shapes' numbers
                traceback.print_exc()
    save()


def _result_name(quant="none"):
    """The record's file name, with the time it starts: a second run into the same
    --out (a --tune, then a --quick in one device call) must not overwrite the first."""
    tag = "" if quant == "none" else f"-{quant}"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    return f"gmm-{stamp}-{tuning.gpu_name()}{tag}.json"


class _Stopped(Exception):
    """The run was signalled to stop (``run_children``)."""


def run_children(args, shapes, record):
    """One child process per shape (and one for --tune): each starts with all GPU
    memory free, and a crash or timeout loses one shape, not the run. The
    merged record is rewritten after every child. A SIGTERM (``timeout``'s: it
    signals the child too) stops the run but first merges the rows the current
    child finished (it saves after each) and writes the record."""
    def stop(signum, frame):
        raise _Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        _run_children(args, shapes, record)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_children(args, shapes, record):
    base = [sys.executable, __file__, "--iters", str(args.iters), "--impls", args.impls,
            "--out", args.out, "--commit", args.commit, "--quant", args.quant]
    base += ["--quick"] * args.quick + ["--smoke"] * args.smoke
    spec = lambda s: ["--shape", ",".join(map(str, s))]
    jobs = []
    if args.tune and not args.smoke:
        tuned = [s for s in shapes if s[1] == 32] or shapes  # as in main()
        jobs.append(["--tune", "--tune-only"] + sum((spec(s) for s in tuned), []))
    jobs += [spec(s) for s in shapes]
    path = pathlib.Path(args.out, _result_name(args.quant))
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    for extra in jobs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            part = f.name
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 30:
            print("time budget spent; skipped", extra)
            record.setdefault("skipped", []).append(extra)
            continue
        stopped = False
        try:
            subprocess.run(base + extra + ["--inner", part], check=False, timeout=left)
        except subprocess.TimeoutExpired:
            print("child timed out:", extra)
            record.setdefault("skipped", []).append(extra)
        except _Stopped:
            print("stopped (SIGTERM) during", extra, "- keeping the rows it finished")
            record.setdefault("skipped", []).append(extra)
            stopped = True
        try:
            child = json.loads(pathlib.Path(part).read_text())
        except (OSError, ValueError):
            print("child produced no record:", extra)
            child = None
        if child is not None:
            record["results"] += child["results"]
            record["tuning_sweep"] += child["tuning_sweep"]
            record.setdefault("tilings", {}).update(child.get("tilings", {}))
            path.write_text(json.dumps(record, indent=1) + "\n")
        if stopped:
            break
    path.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", path)
    print_summary(record)


def print_summary(record):
    """One line per (shape, layout): ours TF/s and ratios to dense and torch."""
    print("\nsummary: ours TF/s (ours/dense, ours/torch)")
    for row in record["results"]:
        t = row["tflops"]
        cells = []
        for op in OPS:
            ours, dense, tor = (t.get(i, {}).get(op) for i in ("ours", "dense", "torch"))
            if ours is None:
                cells.append(f"{op} -")
                continue
            r1 = f"{ours / dense:.2f}" if dense else "-"
            r2 = f"{ours / tor:.2f}" if tor else "-"
            cells.append(f"{op} {ours:.0f} ({r1},{r2})")
        print(f"M={row['M']} G={row['G']} K={row['K']} N={row['N']} {row['layout']:12s} " + " | ".join(cells))
        if row.get("quant"):
            q, o, d8 = (t.get(i, {}) for i in ("ours_q", "ours", "dense8"))
            print(f"  {row['quant']} TF/s (/ours bf16, /dense fp8): " + " | ".join(
                f"{op} {q[op]:.0f} ({q[op] / o[op]:.2f},"
                f"{q[op] / d8[op]:.2f})" if q.get(op) and o.get(op) and d8.get(op) else f"{op} -"
                for op in OPS))
            k8 = t.get("fp8k", {})
            if k8:
                print("  fp8k (kernel only) TF/s (/ours bf16, /dense fp8): " + " | ".join(
                    f"{op} {k8[op]:.0f} ({k8[op] / o[op]:.2f},{k8[op] / d8[op]:.2f})"
                    if k8.get(op) and o.get(op) and d8.get(op) else f"{op} -" for op in OPS))


if __name__ == "__main__":
    main()
