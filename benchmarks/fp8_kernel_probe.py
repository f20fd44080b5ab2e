"""The FP8 blockwise kernels alone: tile-order and pipeline variants, and one call for a profiler.

Legend: M rows, K x N the weight dims (w [G, K, N]), G groups.

Sweep mode (default) times the forward and dgrad kernel
(``mosaic_fp8.gmm_fp8_blockwise``) and the wgrad kernel
(``mosaic_fp8_tgmm.tgmm_fp8_blockwise``) on codes and scales prepared
outside the timing (random data; group sizes from ``benchmarks/gmm.py``'s
``--layout``, same generator and seed, rounded down to 128 rows as training
pads FP8 groups: the wgrad kernel's contract), over the variants in
``VARIANTS`` and ``WGRAD_VARIANTS`` (each of the latter with float32 and
bf16 output), with CUPTI kernel time (median), the wall-clock time of the
jitted call and the GPU's clocks over both (``gpu_clocks``, ``perf.clocks``;
the table's SM MHz is their median), checks that the variants of each
product agree bit for bit, and writes a ``fp8_kernels`` record. ``--variants=`` (empty) skips fwd and
dgrad. ``--once VARIANT`` runs one kernel (``--product``) three times and
exits (a wgrad variant with the suffix ``_bf16``: bf16 output): the run to put under Nsight Compute
(``ncu --launch-skip 2 --launch-count 1 -k regex:mosaic``). ``--sustain SECONDS`` runs
each kernel back to back that long before timing it, so the timing sees the clock the
board's power limit allows under sustained load (a training step runs there) rather
than whatever clock a cold GPU gives a few milliseconds of work.

  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py [--shape M,G,K,N] [--out DIR]
  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py --variants= \
      --wgrad-variants wgrad_rows_overlap,wgrad_rows
  # fwd and dgrad with and without overlap:
  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py --wgrad-variants= \
      --variants rows_gtw8,rows_gtw8_overlap,cols_gtw1,cols_gtw1_overlap
  # fwd and dgrad with each CTA's tile pipelines chained, at both DeepSeek-V3 expert shapes:
  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py --wgrad-variants= \
      --variants rows_gtw8,rows_gtw8_chain --shape 65536,32,2048,7168
  # wgrad with each CTA's tiles in one pipeline, at G=32 and at Qwen3-30B's G=128:
  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py --variants= \
      --wgrad-variants wgrad_rows_overlap_sorted,wgrad_rows_overlap_sorted_chain
  # wgrad's tile orders under skew at a Qwen3-30B shape:
  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py --variants= --shape 65536,128,768,2048 \
      --layout dirichlet0.3 --wgrad-variants wgrad_rows_overlap,wgrad_rows_overlap_sorted
"""

import argparse
import os
import pathlib
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dropless.ops.gmm import mosaic_fp8, mosaic_fp8_tgmm  # noqa: E402
from dropless.perf import measure  # noqa: E402
from dropless.perf.bench import load_module  # noqa: E402
from dropless.perf.clocks import ClockSampler  # noqa: E402

BENCH_DIR = pathlib.Path(__file__).parent

# name -> keyword arguments of gmm_fp8_blockwise (rows_gtw8: its defaults, what
# training runs); the first named is the reference of the bitwise check. overlap:
# promotion during the next step's wgmma (``mosaic_fp8``'s module docstring).
VARIANTS = {
    "cols_gtw1": dict(split="columns", grid_tile_width=1),
    "rows_gtw8": dict(split="rows", grid_tile_width=8),
    "rows_gtw4": dict(split="rows", grid_tile_width=4),
    "rows_gtw8_s3": dict(split="rows", grid_tile_width=8, num_stages=3),
    "rows_gtw8_overlap": dict(split="rows", grid_tile_width=8, overlap=True),
    "cols_gtw1_overlap": dict(split="columns", grid_tile_width=1, overlap=True),
    # each CTA's tile pipelines chained: the next tile's loads start before this one ends
    "rows_gtw8_chain": dict(split="rows", grid_tile_width=8, chain=True),
    # the scales' proxy fence with commit_smem's warpgroup barrier, then also the
    # weight scales from global memory (the default until 2026-12-04)
    "rows_gtw8_commit": dict(split="rows", grid_tile_width=8, scale_fence="commit"),
    # each step as 2 (4) wgmmas over 64 (32) columns, each slice promoted while the
    # later ones run
    "rows_gtw8_halves": dict(split="rows", grid_tile_width=8, parts=2),
    "rows_gtw8_quarters": dict(split="rows", grid_tile_width=8, parts=4),
    "rows_gtw8_halves_nofence": dict(split="rows", grid_tile_width=8, parts=2,
                                     scale_fence="none"),
    # 96 + 32 columns: the long slice promoted under the short slice's wgmma, 16 of a
    # thread's 64 multiply-adds after the last wait (the halves leave 32 there)
    "rows_gtw8_p96_32": dict(split="rows", grid_tile_width=8, parts=(96, 32)),
    # the halves across steps: each promotion under a wgmma (slots released a step late)
    "rows_gtw8_xhalves": dict(split="rows", grid_tile_width=8, parts=2, overlap=True),
    "rows_gtw8_xhalves_nofence": dict(split="rows", grid_tile_width=8, parts=2, overlap=True,
                                      scale_fence="none"),
    "rows_gtw8_p96_32_nofence": dict(split="rows", grid_tile_width=8, parts=(96, 32),
                                     scale_fence="none"),
    # no fence: the slot's release barrier alone orders the scale reads (as DeepGEMM)
    "rows_gtw8_nofence": dict(split="rows", grid_tile_width=8, scale_fence="none"),
    # 64 x 192 per warpgroup (128 x 192 CTA tiles, as DeepGEMM's widest with 128x128
    # weight scales): each 64-column chunk scaled by its weight block's scale
    "rows_gtw8_o192": dict(split="rows", grid_tile_width=8, block_o=192),
    # the default's scale reads and their fence under the wgmma instead of before it
    # (``mosaic_fp8.SCALE_READS``); even with the default on the H200
    # (``fp8_kernels-20261206-215854``)
    "rows_gtw8_o192_under": dict(split="rows", grid_tile_width=8, block_o=192,
                                 scale_reads="under"),
    "rows_gtw8_o192_nofence": dict(split="rows", grid_tile_width=8, block_o=192,
                                   scale_fence="none"),
    "rows_gtw8_o192_batched": dict(split="rows", grid_tile_width=8, block_o=192,
                                   epilogue="batched"),
    "rows_gtw8_gmem_commit": dict(split="rows", grid_tile_width=8, weight_scales="gmem",
                                  scale_fence="commit"),
    # five stages: the rows split's stage is 32.6 KiB, so five fit beside the epilogue
    "rows_gtw8_s5": dict(split="rows", grid_tile_width=8, num_stages=5),
    # each step's slot released once its wgmma completes, before the promotion
    "rows_gtw8_early": dict(split="rows", grid_tile_width=8, early_release=True),
    # warpgroup 1 starts each tile one wgmma after warpgroup 0, then both run free
    "rows_gtw8_stagger": dict(split="rows", grid_tile_width=8, stagger=True),
    # both 64x64 chunks of a warpgroup's whole tile written under one fence
    "rows_gtw8_batched": dict(split="rows", grid_tile_width=8, epilogue="batched"),
    # CTAs in pairs on 256-row tiles, the weight tile loaded once and multicast into
    # both (``cluster=2``); band sweeps of 8 and 4 pair tiles (16 and 8 row tiles)
    "rows_gtw8_cluster": dict(split="rows", grid_tile_width=8, cluster=2),
    "rows_gtw4_cluster": dict(split="rows", grid_tile_width=4, cluster=2),
}
# name -> keyword arguments of tgmm_fp8_blockwise; the first, the kernel's default
# (what training runs), is the reference of the bitwise check. overlap: promotion
# during the next step's wgmma; sorted: the tile order that balances the SMs under
# skewed group sizes (``mosaic_gmm.walk_tiles``).
WGRAD_VARIANTS = {
    # one pipeline over all of a CTA's tiles: the next tile's loads start before this one ends
    "wgrad_rows_overlap_sorted_chain": dict(split="rows", overlap=True, tile_order="sorted_snake",
                                            chain=True),
    # the scale reads' proxy fence per thread, without commit_smem's warpgroup barrier
    "wgrad_rows_overlap_sorted_chain_fence": dict(split="rows", overlap=True,
                                                  tile_order="sorted_snake", chain=True,
                                                  scale_fence="thread"),
    # the plain step as 2 (4) wgmmas over 64 (32) columns, each slice promoted while the
    # later ones run
    "wgrad_rows_halves_sorted_chain": dict(split="rows", overlap=False, tile_order="sorted_snake",
                                           chain=True, parts=2),
    # the halves with the scale reads unfenced (the forward's two gained together what
    # neither did alone, 2026-12-04 late night)
    "wgrad_rows_halves_sorted_chain_nofence": dict(split="rows", overlap=False,
                                                   tile_order="sorted_snake", chain=True,
                                                   parts=2, scale_fence="none"),
    "wgrad_rows_p96_32_sorted_chain": dict(split="rows", overlap=False,
                                           tile_order="sorted_snake", chain=True,
                                           parts=(96, 32)),
    "wgrad_rows_quarters_sorted_chain": dict(split="rows", overlap=False,
                                             tile_order="sorted_snake", chain=True, parts=4),
    "wgrad_rows_sorted_chain": dict(split="rows", overlap=False, tile_order="sorted_snake",
                                    chain=True),
    # wider warpgroup tiles with the plain step (64 x 160 and 64 x 192 per warpgroup, as
    # DeepGEMM's 128x152 CTA tiles); the last N band runs past N (4096 = 25.6 x 160)
    "wgrad_rows_n160_sorted_chain": dict(split="rows", overlap=False, tile_order="sorted_snake",
                                         chain=True, block_n=160),
    # its scale reads (22 per thread) and their fence and barrier under the wgmma: 0.86x the
    # default on the H200 (``fp8_kernels-20261206-215854``)
    "wgrad_rows_n160_sorted_chain_under": dict(split="rows", overlap=False,
                                               tile_order="sorted_snake", chain=True,
                                               block_n=160, scale_reads="under"),
    "wgrad_rows_n192_sorted_chain": dict(split="rows", overlap=False, tile_order="sorted_snake",
                                         chain=True, block_n=192),
    # the wide tiles in halves (80 + 80, 96 + 96 columns), as the 128-column halves above
    "wgrad_rows_n160_halves_sorted_chain": dict(split="rows", overlap=False,
                                                tile_order="sorted_snake", chain=True,
                                                block_n=160, parts=2),
    "wgrad_rows_n192_halves_sorted_chain": dict(split="rows", overlap=False,
                                                tile_order="sorted_snake", chain=True,
                                                block_n=192, parts=2),
    # no fence and no warpgroup barrier: the slot's release barrier alone (as DeepGEMM)
    "wgrad_rows_overlap_sorted_chain_nofence": dict(split="rows", overlap=True,
                                                    tile_order="sorted_snake", chain=True,
                                                    scale_fence="none"),
    # each output tile's two 64x64 chunks fenced and stored one by one (the default for
    # float32 output; for bf16 until 2026-12-04), or both under one fence (the bf16 default)
    "wgrad_rows_overlap_sorted_chain_chunks": dict(split="rows", overlap=True,
                                                   tile_order="sorted_snake", chain=True,
                                                   epilogue="chunks"),
    "wgrad_rows_overlap_sorted_chain_batched": dict(split="rows", overlap=True,
                                                    tile_order="sorted_snake", chain=True,
                                                    epilogue="batched"),
    # each tile's group data read rounds ahead (mosaic_gmm.walk_tiles_prefetched)
    "wgrad_rows_overlap_sorted_chain_prefetch": dict(split="rows", overlap=True,
                                                     tile_order="sorted_snake", chain=True,
                                                     prefetch=True),
    # a pipeline per output tile (the default until 2026-12-03)
    "wgrad_rows_overlap_sorted": dict(split="rows", overlap=True, tile_order="sorted_snake",
                                      chain=False),
    # the tile orders and splits, each a pipeline per tile
    "wgrad_rows_overlap": dict(split="rows", overlap=True, tile_order="groups", chain=False),
    "wgrad_rows": dict(split="rows", overlap=False, tile_order="groups", chain=False),
    "wgrad_columns_overlap": dict(split="columns", overlap=True, tile_order="groups",
                                  chain=False),
    "wgrad_columns": dict(split="columns", overlap=False, tile_order="groups", chain=False),
}


def cupti_ms(fn, args, iters):
    jax.block_until_ready(fn(*args))
    return statistics.median(measure.cupti_kernel_ms(fn, *args, iters=iters))


def group_sizes(gmm, layout, m, g):
    """``gmm.py``'s sizes for ``layout`` (seed G, as its records), each rounded down to
    the 128-row scale block; the rows taken off go to the largest group."""
    sizes = gmm.make_group_sizes(layout, m, g, seed=g)
    return gmm.align_group_sizes(sizes, mosaic_fp8.BLOCK)


def operands(m, g, k, n, sizes):
    # Drawn on the device: at G=256 the weight has 7.5 G elements, which numpy's
    # float64 generator took longer than a 90 s limit to produce (2026-12-04).
    kx, kdy, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    dy = jax.random.normal(kdy, (m, n), jnp.bfloat16)
    # The weight is drawn and quantized 32 groups at a time: whole, at G=256 its float32
    # intermediates (28 GiB each) ran the device out of memory (2026-12-04).
    parts = [mosaic_fp8.quantize_weight(
        jax.random.normal(jax.random.fold_in(kw, i), (min(32, g - i), k, n), jnp.bfloat16)
        * jnp.bfloat16(1 / np.sqrt(k))) for i in range(0, g, 32)]
    wq = jnp.concatenate([q for q, _ in parts])
    sw = jnp.concatenate([s for _, s in parts])
    del parts
    gs = jnp.asarray(sizes, jnp.int32)
    ops = {"fwd": mosaic_fp8.fwd_operands(x, wq, sw), "dgrad": mosaic_fp8.dgrad_operands(dy, wq, sw),
           "wgrad": mosaic_fp8_tgmm.wgrad_operands(x, dy)}
    return jax.block_until_ready(ops), gs


def heat(f, args, seconds):
    """Run ``f(args)`` back to back for ``seconds`` (``--sustain``): the GPU settles at the
    clock its power limit allows under this kernel, as under a training step."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(8):  # a few calls queued ahead, so the GPU never idles
            out = f(args)
        jax.block_until_ready(out)


def time_job(v, prod, ops, gs, flops, iters, clocks, record, sustain=0.0):
    """Time variant ``v`` of ``prod`` (CUPTI and wall clock) and append its row to ``record``,
    with the GPU's clocks over the timing (``perf.clocks``: a short kernel run may see a
    higher clock than a sustained step). With ``sustain`` seconds, a second
    row (``"sustained": True``) times it again after that long back to back (``heat``),
    so the two clocks are compared within one process; the first then follows a
    second's rest, so the previous job's heat does not carry into it."""
    if prod == "wgrad":
        f = jax.jit(lambda o, kw=WGRAD_VARIANTS[v.removesuffix("_bf16")],
                    dt=jnp.bfloat16 if v.endswith("_bf16") else jnp.float32:
                    mosaic_fp8_tgmm.tgmm_fp8_blockwise(*o, gs, out_dtype=dt, **kw))
    else:
        f = jax.jit(lambda o, kw=VARIANTS[v]: mosaic_fp8.gmm_fp8_blockwise(*o, gs, **kw))
    try:
        jax.block_until_ready(f(ops[prod]))  # compiled outside the clocks' window
        if sustain:
            time.sleep(1.0)
        timed = [_timed(f, ops[prod], iters, clocks, f"{v}/{prod}")]
        if sustain:
            heat(f, ops[prod], sustain)
            timed.append(_timed(f, ops[prod], iters, clocks, f"{v}/{prod}/sustained"))
    except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
        print(f"{v:<30} {prod:<6} failed: {type(e).__name__}: {str(e)[:200]}")
        record["rows"].append({"variant": v, "product": prod, "error": str(e)[:500]})
        return
    for sustained, (kms, wms, clock) in enumerate(timed):
        row = {"variant": v, "product": prod, "kernel_ms": kms, "wall_ms": wms,
               "tflops_kernel": flops / kms / 1e9, "tflops_wall": flops / wms / 1e9,
               "gpu_clocks": clock}
        if sustain:
            row["sustained"] = bool(sustained)
        record["rows"].append(row)
        mhz = clock.get("sm_mhz_median")
        print(f"{v + (' (sustained)' if sustained else ''):<30} {prod:<6} {kms:>9.3f} "
              f"{wms:>8.3f} {row['tflops_kernel']:>9.0f} {row['tflops_wall']:>9.0f} "
              f"{'-' if mhz is None else f'{mhz:.0f}':>6}")


def _timed(f, args, iters, clocks, window):
    """(CUPTI median ms, wall-clock median ms, the clocks over both) of ``f(args)``."""
    with clocks.window(window):
        kms = cupti_ms(f, (args,), iters)
        wms = measure.time_fn(f, args, iters=iters)["median_ms"]
    return kms, wms, clocks.summary(window)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", help="M,G,K,N (default: DeepSeek-V3's gate/up expert GEMM at "
                   "expert parallelism 8, from its preset, as gmm.py reads it: 65536,32,7168,4096)")
    p.add_argument("--layout", default="balanced", help="group sizes: one of gmm.py's LAYOUTS")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS), help="fwd/dgrad; empty: none")
    p.add_argument("--wgrad-variants", default=",".join(WGRAD_VARIANTS), help="empty: none")
    p.add_argument("--once", metavar="VARIANT",
                   help="run the --product kernel 3 times and exit")
    p.add_argument("--product", default="fwd", choices=["fwd", "dgrad", "wgrad"])
    p.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                   help="run each kernel back to back this long before timing it: the "
                   "clock a sustained load settles at (the power limit), not the rated one")
    p.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    a = p.parse_args(argv)
    gmm = load_module("gmm", BENCH_DIR)
    try:
        m, g, k, n = (map(int, a.shape.split(",")) if a.shape
                      else gmm.preset_expert_shapes("deepseek3-671b", ep=8)[0])
    except ValueError:
        p.error(f"--shape {a.shape}: expected M,G,K,N")
    if a.layout not in gmm.LAYOUTS:
        p.error(f"unknown --layout {a.layout}; known: {', '.join(gmm.LAYOUTS)}")
    names = [v for v in a.variants.split(",") if v]
    wgrad_names = [v for v in a.wgrad_variants.split(",") if v]
    unknown = ([v for v in names if v not in VARIANTS]
               + [v for v in wgrad_names if v not in WGRAD_VARIANTS])
    if a.once:  # a wgrad variant may carry the sweep's "_bf16" suffix: bf16 output
        once = a.once.removesuffix("_bf16") if a.product == "wgrad" else a.once
        unknown = [a.once] if once not in (WGRAD_VARIANTS if a.product == "wgrad"
                                           else VARIANTS) else []
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}")
    sizes = group_sizes(gmm, a.layout, m, g)
    ops, gs = operands(m, g, k, n, sizes)
    if a.once:
        if a.product == "wgrad":
            dt = jnp.bfloat16 if a.once.endswith("_bf16") else jnp.float32
            f = jax.jit(lambda o: mosaic_fp8_tgmm.tgmm_fp8_blockwise(
                *o, gs, out_dtype=dt, **WGRAD_VARIANTS[once]))
        else:
            f = jax.jit(lambda o: mosaic_fp8.gmm_fp8_blockwise(*o, gs, **VARIANTS[a.once]))
        for _ in range(3):
            jax.block_until_ready(f(ops[a.product]))
        return 0
    flops = 2 * int(sizes.sum()) * k * n  # real rows only, as gmm.py counts
    record = measure.new_record("fp8_kernels", {"M": m, "G": g, "K": k, "N": n,
                                                "layout": a.layout, "rows": int(sizes.sum()),
                                                "max_group": int(sizes.max()), "iters": a.iters,
                                                "sustain_s": a.sustain,
                                                "variants": VARIANTS,
                                                "wgrad_variants": WGRAD_VARIANTS})
    print(f"{'variant':<30} {'product':<6} {'kernel ms':>9} {'wall ms':>8} {'TF/s kern':>9} "
          f"{'TF/s wall':>9} {'SM MHz':>6}")
    jobs = [(v, prod) for v in names for prod in ("fwd", "dgrad")]
    # wgrad with float32 output (the probe's earlier records) and with bf16, what
    # training writes for bf16 weights (half the output bytes).
    jobs += [(f"{v}{dt}", "wgrad") for v in wgrad_names for dt in ("", "_bf16")]
    # The record is rewritten (atomically, under one name) after every job and marked
    # "complete" only at the end: a run cut by its time limit keeps the rows it timed.
    record["complete"] = False
    with ClockSampler() as clocks:
        for v, prod in jobs:
            time_job(v, prod, ops, gs, flops, a.iters, clocks, record, a.sustain)
            measure.write_record(record, a.out)
    # Every variant computes each output element from the same wgmma steps in the
    # same order, so the results must agree bit for bit with the first variant.
    run = {"fwd": lambda v: mosaic_fp8.gmm_fp8_blockwise(*ops["fwd"], gs, **VARIANTS[v]),
           "dgrad": lambda v: mosaic_fp8.gmm_fp8_blockwise(*ops["dgrad"], gs, **VARIANTS[v]),
           "wgrad": lambda v: mosaic_fp8_tgmm.tgmm_fp8_blockwise(*ops["wgrad"], gs,
                                                                 **WGRAD_VARIANTS[v])}
    for prod, prod_names in (("fwd", names), ("dgrad", names), ("wgrad", wgrad_names)):
        if len(prod_names) < 2:
            continue
        want = np.asarray(run[prod](prod_names[0]).astype(jnp.float32))
        for v in prod_names[1:]:
            try:
                same = bool(np.array_equal(np.asarray(run[prod](v).astype(jnp.float32)), want))
            except Exception as e:  # noqa: BLE001 - reported above with its timing row
                print(f"{prod} {v}: failed: {type(e).__name__}")
                continue
            record["rows"].append({"variant": v, "product": prod,
                                   "bitwise_equal_to": prod_names[0], "equal": same})
            print(f"{prod} {v} == {prod_names[0]}: {same}")
    record["complete"] = True
    print(f"record: {measure.write_record(record, a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
