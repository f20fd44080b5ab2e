"""The bf16 forward/dgrad kernel's row-tile size under skewed group sizes, in one process.

Legend: M rows, K x N the weight dims (w [G, K, N]), G groups.

The bf16 grouped GEMM forward and dgrad (``mosaic.gmm``, kernel
``mosaic_gmm.gmm``) compute one CTA tile per (row block of block_m rows,
group) pair that intersect (``schedule.row_tile_schedule``): a row block
holding a group boundary is computed once per group in it. At M=65536, G=256
with ``benchmarks/gmm.py``'s Dirichlet(0.3) group sizes (its records' seed,
G), block_m=128 visits 727 row tiles where 512 would cover the rows (1.42x
the work) and block_m=64 visits 1238 of 1024 (1.21x); the forward measured
503 TF/s there against 720 on balanced sizes, which the 1.42x explains. This
probe answers whether a block_m=64 tiling beats the tuning table's at high G
under skew.

For each shape and layout (``gmm.py``'s generator and seed, so the same group
sizes as the gmm records) and each product (fwd: x @ w[g]; dgrad: dy @ w[g]^T)
it times every tiling of ``--tilings`` (``TILINGS``: the table's, and named
candidates; one that does not divide the shape is skipped) and the dense cuBLAS
product at equal FLOPs (``gmm.py``'s dense columns, timed once per shape). Per
tiling it reports the live row tiles of the schedule and their overhead
(tiles / (M / block_m)), CUPTI kernel time (median of ``--iters``), the
wall-clock time of the jitted call (median), TF/s of both (FLOPs = 2 *
sum(group_sizes) * K * N), the ratio to dense, and whether the output equals
the first tiling's bit for bit (reported, not asserted: tilings may sum in
another order). ``--smoke`` runs a tiny shape in Pallas GPU interpret mode on
CPU, one timed call each (about 80 s on two cores: 20 kernels at about 4 s
each, mostly the interpreter's tracing and first call), and also reports each
output's relative error against the float32 reference (``ops.gmm.reference``). A tiling that fails
is reported and recorded; the others still run. Writes a ``gmm_tile_probe``
record, again after each shape.

  python3 benchmarks/gmm_tile_probe.py --out $OUT        # on the GPU machine
  python3 benchmarks/gmm_tile_probe.py --tilings table,m64_n128_w8_chain --products fwd \
      --shape 65536,256,7168,4096 --layouts dirichlet0.3
  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/gmm_tile_probe.py --smoke --out /tmp/x
"""

import argparse
import contextlib
import dataclasses
import functools
import os
import pathlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dropless.ops.gmm import mosaic, reference, schedule, tuning  # noqa: E402
from dropless.ops.gmm.tuning import GmmTiling  # noqa: E402
from dropless.perf import measure  # noqa: E402
from dropless.perf.bench import load_module  # noqa: E402

BENCH_DIR = pathlib.Path(__file__).parent

# DeepSeek-V3's expert GEMMs without expert parallelism (G=256), gate|up and down, from
# the preset users run (``gmm.preset_expert_shapes``): M=65536 K=7168 N=4096 and K=2048
# N=7168.
DEFAULT_PRESET = "deepseek3-671b"
# The smallest K and N every tiling below divides in both products (out columns a
# multiple of 2 * 256), and two groups in two 64-row blocks: balanced, block_m=128
# computes its one block twice; Dirichlet(0.3) sizes are 2 and 126 rows.
SMOKE_SHAPE = (128, 2, 512, 512)
PRODUCTS = ("fwd", "dgrad")
# name -> tiling; None: the tuning table's for the product and shape (``tuning.lookup``;
# on the H200 at the default shapes, 128 x 2*128 tiles, grid_tile_width 8, chained).
# The first of ``--tilings`` that runs is the reference of the bitwise check. A CTA's
# two compute warpgroups each hold a block_m x block_n float32 accumulator. Its smem
# at block_k 64 and a bf16 output: num_stages x (block_m + 2 * block_n) x 64 x 2 bytes
# of load ring plus 2 x 64 x block_n x 2 of epilogue buffers, of the H200's 227 KiB
# (128 x 128, 4 stages: 192 + 32 KiB).
TILINGS = {
    "table": None,
    # the table's tile without the chain: the block_m=128 side of the plain pair
    "m128_n128_w8": GmmTiling(block_m=128, block_n=128, grid_tile_width=8),
    # the DeepSeek-V3 shapes' table entry (chained), and ``tuning.default_tiling``'s
    # until 2026-12-04 (bands of one row tile), for shapes the table lacks
    "m128_n128_w8_chain": GmmTiling(block_m=128, block_n=128, grid_tile_width=8, chain=True),
    "m128_n128_w1": GmmTiling(block_m=128, block_n=128, grid_tile_width=1),
    # half the rows, the same columns: 160 KiB ring + 32 KiB epilogue
    "m64_n128_w8": GmmTiling(block_m=64, block_n=128, grid_tile_width=8),
    "m64_n128_w8_chain": GmmTiling(block_m=64, block_n=128, grid_tile_width=8, chain=True),
    # the same accumulator size as 128 x 128, twice the columns per CTA (each weight
    # tile read by half as many CTAs): 144 + 64 KiB; 4 stages (352 KiB) and 3 (280 KiB)
    # exceed smem
    "m64_n256_w8_s2": GmmTiling(block_m=64, block_n=256, num_stages=2, grid_tile_width=8),
}


def resolve(name, kind, k, n):
    """The tiling ``name`` stands for in ``kind`` at (K, N)."""
    return TILINGS[name] or tuning.lookup(kind, jnp.bfloat16, k, n)


def row_tiles(sizes, m, block_m):
    """Live row tiles of a real group (not tail) in the kernel's schedule."""
    sched = schedule.row_tile_schedule(jnp.asarray(sizes), m, block_m)
    return int(jnp.sum(sched.group_T >= 0))


@functools.cache  # one compile per (product, tiling, shape), whatever the layouts
def product_fn(product, tiling):
    """Jitted fn(x, w, dy, gs) of one product, as ``gmm.py``'s ``tune`` calls it."""
    if product == "fwd":
        return jax.jit(lambda x, w, dy, gs: mosaic.gmm(x, w, gs, tiling=tiling))
    return jax.jit(lambda x, w, dy, gs: mosaic.gmm(dy, w, gs, transpose_rhs=True, tiling=tiling))


def timed(gmm, fn, args, iters):
    """(output, kernel ms, wall ms) of fn(*args). The first call (compile, warm-up) gives
    the output that is checked; then CUPTI kernel time (``gmm.time_jax``) and the wall
    clock of the jitted call (``gmm.wall_clock_ms``), medians of ``iters``. Off the GPU
    (``--smoke``) there is no kernel time, and ``iters`` calls, waited for one by one,
    give the wall clock: Pallas's GPU interpreter takes about a second per call."""
    out = jax.block_until_ready(fn(*args))
    if jax.default_backend() != "gpu":
        return out, None, measure.time_fn(fn, *args, warmup=0, iters=iters, reps=1)["median_ms"]
    kernel_ms, how = gmm.time_jax(fn, args, iters)  # how: "wallclock" where CUPTI failed
    return out, kernel_ms if how == "cupti" else None, gmm.wall_clock_ms(fn, args, iters)


def tflops(flops, ms):
    return flops / ms / 1e9 if ms else None


def ratio(a, b):
    return a / b if a and b else None


def time_dense(gmm, args, shape, products, iters):
    """{product: row} of the dense cuBLAS product over all M rows, x or dy times w[0]
    (``gmm.py``'s dense)."""
    m, g, k, n = shape
    fns = gmm.jax_fns("dense", g, {}, gmm.JAXEX_CFG)
    flops = 2.0 * m * k * n
    dense = {}
    for product in products:
        try:
            _, kernel_ms, wall_ms = timed(gmm, fns[product], args, iters)
        except Exception as e:  # noqa: BLE001 - the tilings' numbers stand without it
            print(f"  dense {product}: failed: {type(e).__name__}: {str(e)[:200]}")
            dense[product] = {"error": str(e)[:500]}
            continue
        dense[product] = {"kernel_ms": kernel_ms, "wall_ms": wall_ms,
                          "tflops_kernel": tflops(flops, kernel_ms),
                          "tflops_wall": tflops(flops, wall_ms)}
    return dense


def probe_tiling(gmm, run, name, args, iters, record):
    """Time one tiling of one (shape, layout, product); its row is added to the record.
    Returns its output, or None when it was skipped or failed."""
    (m, _, k, n), layout, product, sizes = run["shape"], run["layout"], run["product"], run["sizes"]
    row = {"shape": run["shape"], "layout": layout, "product": product, "tiling": name}
    record["rows"].append(row)
    tiling = resolve(name, product, k, n)
    row["tiling_config"] = dataclasses.asdict(tiling)
    if not tuning.fits(tiling, product, k, n):
        row["skipped"] = "does not divide the shape (tuning.fits)"
        print(f"  {product:<6} {name:<18} skipped: {tiling} does not divide K={k} N={n}")
        return None
    try:
        out, kernel_ms, wall_ms = timed(gmm, product_fn(product, tiling), args, iters)
    except Exception as e:  # noqa: BLE001 - one tiling failing must not lose the others
        row["error"] = str(e)[:500]
        print(f"  {product:<6} {name:<18} failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    flops = 2.0 * int(sizes.sum()) * k * n
    tiles = row_tiles(sizes, m, tiling.block_m)
    dense = run["dense"]
    row.update(tiles=tiles, overhead=tiles / (m / tiling.block_m), kernel_ms=kernel_ms,
               wall_ms=wall_ms, tflops_kernel=tflops(flops, kernel_ms),
               tflops_wall=tflops(flops, wall_ms))
    row.update(vs_dense=ratio(row["tflops_kernel"], dense.get("tflops_kernel")),
               vs_dense_wall=ratio(row["tflops_wall"], dense.get("tflops_wall")))
    return out


def check(row, out, first, ref):
    """Add the bitwise comparison with the first tiling's output and, given the float32
    reference, the relative error ||out - ref|| / ||ref|| to ``row``."""
    if first is not None:
        row["bitwise_equal_to"], first_out = first
        row["equal"] = bool(jnp.array_equal(out, first_out))
    if ref is not None:
        out32 = out.astype(jnp.float32)
        row["rel_err_vs_reference"] = float(jnp.linalg.norm(out32 - ref) / jnp.linalg.norm(ref))


def print_header(shape, layout, sizes):
    m, g, k, n = shape
    print(f"M={m} G={g} K={k} N={n} {layout} (groups {sizes.min()}..{sizes.max()})")
    print(f"  {'product':<6} {'tiling':<18} {'tiles':>6} {'overhead':>8} {'kernel ms':>9} "
          f"{'wall ms':>8} {'TF/s kern':>9} {'TF/s wall':>9} {'x dense':>7}  equal")


def print_row(product, name, row):
    cell = lambda key, fmt: format(row[key], fmt) if row.get(key) is not None else "-"
    equal = row.get("equal", "-")
    err = f"  rel err {row['rel_err_vs_reference']:.1e}" if "rel_err_vs_reference" in row else ""
    print(f"  {product:<6} {name:<18} {cell('tiles', 'd'):>6} {cell('overhead', '.3f'):>8} "
          f"{cell('kernel_ms', '.3f'):>9} {cell('wall_ms', '.3f'):>8} "
          f"{cell('tflops_kernel', '.0f'):>9} {cell('tflops_wall', '.0f'):>9} "
          f"{cell('vs_dense', '.3f'):>7}  {equal}{err}")


def probe_shape(gmm, shape, a, record):
    """Every (layout, product, tiling) of one shape, against its dense products."""
    m, g, k, n = shape
    args = gmm.random_inputs(m, g, k, n, seed=m + g + k + n)  # x, w, dy as gmm.py's rows
    dense = time_dense(gmm, (*args, None), shape, a.products, a.iters)
    record["dense"][",".join(map(str, shape))] = dense
    for layout in a.layouts:
        sizes = gmm.make_group_sizes(layout, m, g, seed=g)
        gs = jnp.asarray(sizes)
        print_header(shape, layout, sizes)
        for product in a.products:
            print_row(product, "dense", dense[product])
            # the float32 reference only at smoke sizes: G dense products at HIGHEST
            ref = (reference.gmm(args[0] if product == "fwd" else args[2], args[1], gs,
                                 transpose_rhs=product == "dgrad", out_dtype=jnp.float32)
                   if a.smoke else None)
            run = dict(shape=shape, layout=layout, product=product, sizes=sizes,
                       dense=dense[product])
            first = None
            for name in a.tilings:
                out = probe_tiling(gmm, run, name, (*args, gs), a.iters, record)
                row = record["rows"][-1]
                if out is not None:  # else its line is printed
                    check(row, out, first, ref)
                    first = first or (name, out)
                    print_row(product, name, row)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", default=[],
                   help=f"M,G,K,N (repeatable; default: {DEFAULT_PRESET}'s two expert GEMMs, G=256)")
    p.add_argument("--layouts", default="balanced,dirichlet0.3",
                   help="comma list of gmm.py's LAYOUTS")
    p.add_argument("--tilings", default=",".join(TILINGS), help="comma list of TILINGS")
    p.add_argument("--products", default=",".join(PRODUCTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true",
                   help=f"{SMOKE_SHAPE} in Pallas GPU interpret mode (CPU), one timed call")
    p.add_argument("--out", default=os.environ.get("OUT") or str(measure.DEFAULT_RESULTS_DIR))
    p.add_argument("--commit", default="",
                   help="the commit measured (default: $DROPLESS_COMMIT, else git's HEAD)")
    a = p.parse_args(argv)
    gmm = load_module("gmm", BENCH_DIR)
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in a.shape]
        if any(len(s) != 4 for s in shapes):
            raise ValueError
    except ValueError:
        p.error(f"--shape {a.shape}: expected M,G,K,N")
    shapes = shapes or ([SMOKE_SHAPE] if a.smoke else gmm.preset_expert_shapes(DEFAULT_PRESET))
    a.layouts, a.tilings, a.products = (s.split(",") for s in (a.layouts, a.tilings, a.products))
    for given, known, what in ((a.layouts, gmm.LAYOUTS, "layout"), (a.tilings, TILINGS, "tiling"),
                               (a.products, PRODUCTS, "product")):
        if unknown := [v for v in given if v not in known]:
            p.error(f"unknown {what}(s) {unknown}; known: {', '.join(known)}")
    if a.smoke:
        # The smoke run checks the script, not speed; Pallas's GPU interpreter has hung
        # on a 2-core machine after a few dozen kernel calls (gmm.py's --smoke).
        a.iters = 1
    record = measure.new_record("gmm_tile_probe", {
        "shapes": shapes, "layouts": a.layouts, "products": a.products, "iters": a.iters,
        "smoke": a.smoke, "table_gpu": tuning.gpu_name(),
        "tilings": {name: dataclasses.asdict(t) if t else "tuning.lookup"
                    for name, t in TILINGS.items() if name in a.tilings}})
    if a.commit:
        record["commit"] = {"commit": a.commit, "dirty": None, "source": "argument"}
    record["dense"] = {}
    if a.smoke:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpret = plgpu.force_gpu_interpret_mode()
    else:
        interpret = contextlib.nullcontext()
    with interpret:
        for shape in shapes:
            try:
                probe_shape(gmm, shape, a, record)
            except Exception as e:  # noqa: BLE001 - keep the other shapes' numbers
                print(f"{shape}: failed: {type(e).__name__}: {str(e)[:300]}")
                record["rows"].append({"shape": shape, "error": str(e)[:500]})
            # rewritten after each shape (same name): a run cut by a timeout keeps its shapes
            path = measure.write_record(record, a.out)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
