"""The bf16 wgrad kernel's tile orders under skewed group sizes, in one process.

Legend: M rows, K x N the weight dims (dw [G, K, N]), G groups.

For each shape and ``benchmarks/gmm.py`` layout (same generator and seed, so
the same group sizes as the gmm records) times ``mosaic.tgmm`` with
``tile_order="groups"`` and ``"sorted_snake"`` (the default), and, to separate
the cost of group bounds that are not multiples of block_m (one more step per
tile and masked steps; see ``tgmm_balance.py``), both orders again on the
same sizes rounded to block_m (``gmm.align_group_sizes``; the ``_aligned``
rows). Reports CUPTI kernel time (median) and the wall-clock time of the
jitted call, the dense cuBLAS wgrad at equal FLOPs, the model's predicted
time relative to the balanced layout, and a bit-for-bit check that both
orders give the same dw. Writes a ``tgmm_order`` record.

  PYTHONPATH=src python3 benchmarks/tgmm_order_probe.py [--shape M,G,K,N ...] [--out DIR]
"""

import argparse
import os
import pathlib
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from dropless.ops.gmm import mosaic, mosaic_gmm  # noqa: E402
from dropless.perf import measure  # noqa: E402
from dropless.perf.bench import load_module  # noqa: E402

BENCH_DIR = pathlib.Path(__file__).parent

DEFAULT_SHAPES = ["65536,32,7168,4096", "65536,32,2048,7168", "65536,128,2048,1536",
                  "65536,128,768,2048"]
LAYOUTS = ["balanced", "dirichlet1.0", "dirichlet0.3"]
# The costs that fit the 2026-11-29 and 2026-12-02 H200 gmm records best
# (``tgmm_balance.py --fit``), in pipeline steps.
TILE_COST, MASK_COST = 6.0, 1.5


def cupti_ms(fn, args, iters):
    jax.block_until_ready(fn(*args))
    return statistics.median(measure.cupti_kernel_ms(fn, *args, iters=iters))


def timed(fn, args, iters):
    return cupti_ms(fn, args, iters), measure.time_fn(fn, *args, iters=iters)["median_ms"]


def probe_shape(shape, layouts, iters, gmm, balance, record):
    """Time both orders (and the default on aligned sizes) on each layout of one shape."""
    m, g, k, n = shape
    tiling = balance.wgrad_tiling(k, n)
    x, _, dy = gmm.random_inputs(m, g, k, n, seed=m + g + k + n)
    fns = {order: jax.jit(lambda x, dy, gs, order=order: mosaic.tgmm(
        x, dy, gs, num_groups=g, tiling=tiling, tile_order=order))
        for order in ("groups", "sorted_snake")}
    dense = jax.jit(lambda x, dy: lax.dot_general(
        x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype))
    dense_ms = cupti_ms(dense, (x, dy), iters)
    flops = 2.0 * m * k * n
    print(f"M={m} G={g} K={k} N={n} {tiling}; dense wgrad {flops / dense_ms / 1e9:.1f} TF/s")
    for layout in layouts:
        sizes = gmm.make_group_sizes(layout, m, g, seed=g)
        aligned = gmm.align_group_sizes(sizes, tiling.block_m)
        variants = [("", sizes)] + [("_aligned", aligned)] * (not np.array_equal(aligned, sizes))
        for tag, sz in variants:
            outs = {}
            for order, fn in fns.items():
                run = dict(shape=shape, layout=layout, run=order + tag, order=order, sizes=sz)
                outs[order] = _time_run(fn, x, dy, run, dense_ms, iters, gmm, balance, tiling,
                                        record)
            if all(o is not None for o in outs.values()):
                same = bool(np.array_equal(outs["groups"], outs["sorted_snake"]))
                record["rows"].append({"shape": shape, "layout": layout + tag,
                                       "bitwise_equal": same})
                print(f"  {layout + tag:20s} sorted_snake == groups bit for bit: {same}")
    record["dense_ms"][",".join(map(str, shape))] = dense_ms


def _time_run(fn, x, dy, run, dense_ms, iters, gmm, balance, tiling, record):
    """Time one (order, sizes) run, add its row to the record; return dw (f32 NumPy),
    or None if it failed."""
    (m, g, k, n), sz, name = run["shape"], run["sizes"], f"{run['layout']} {run['run']}"
    gs = jnp.asarray(sz)
    try:
        kms, wms = timed(fn, (x, dy, gs), iters)
        dw = np.asarray(fn(x, dy, gs).astype(jnp.float32))
    except Exception as e:  # noqa: BLE001 - one run failing must not lose the others
        print(f"  {name:34s} failed: {type(e).__name__}: {str(e)[:200]}")
        record["rows"].append({"shape": run["shape"], "layout": run["layout"], "run": run["run"],
                               "error": str(e)[:500]})
        return None
    real = 2.0 * int(sz.sum()) * k * n
    imb, rel = _predict(balance, gmm, run["shape"], sz, run["order"], tiling)
    row = {"shape": run["shape"], "layout": run["layout"], "run": run["run"],
           "rows": int(sz.sum()), "kernel_ms": kms, "wall_ms": wms,
           "tflops_kernel": real / kms / 1e9, "tflops_wall": real / wms / 1e9,
           "vs_dense": (real / kms) / (2.0 * m * k * n / dense_ms),
           "model_imbalance": imb, "model_time_vs_balanced_layout": rel}
    record["rows"].append(row)
    print(f"  {name:34s} {kms:8.3f} ms {row['tflops_kernel']:6.1f} TF/s "
          f"(wall {row['tflops_wall']:6.1f}) {row['vs_dense']:.3f}x dense | model "
          f"max/mean {imb:.3f}, time {rel:.3f}x balanced layout")
    return dw


def _predict(balance, gmm, shape, sizes, order, tiling):
    """Model's (max/mean, time relative to the balanced layout) for these exact sizes."""
    m, g, k, n = shape
    kw = dict(m=m, k=k, n=n, tiling=tiling, num_sms=mosaic_gmm.num_sms(),
              tile_cost=TILE_COST, mask_cost=MASK_COST)
    loads = balance.sm_loads(sizes, order=order, **kw)
    base = balance.sm_loads(gmm.make_group_sizes("balanced", m, g, seed=g), **kw)
    return loads.max() / loads.mean(), loads.max() / base.max()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", default=[], help="M,G,K,N (repeatable)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    a = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in a.shape or DEFAULT_SHAPES]
        if any(len(s) != 4 for s in shapes):
            raise ValueError
    except ValueError:
        p.error(f"--shape {a.shape}: expected M,G,K,N")
    layouts = a.layouts.split(",")
    gmm = load_module("gmm", BENCH_DIR)
    balance = load_module("tgmm_balance", BENCH_DIR)
    unknown = [lay for lay in layouts if lay not in gmm.LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; known: {gmm.LAYOUTS}")
    record = measure.new_record("tgmm_order", {"shapes": shapes, "layouts": layouts,
                                               "iters": a.iters, "tile_cost": TILE_COST,
                                               "mask_cost": MASK_COST})
    record["dense_ms"] = {}
    for shape in shapes:
        try:
            probe_shape(shape, layouts, a.iters, gmm, balance, record)
        except Exception as e:  # noqa: BLE001 - keep the other shapes' numbers
            print(f"{shape}: failed: {type(e).__name__}: {str(e)[:300]}")
            record["rows"].append({"shape": shape, "error": str(e)[:500]})
    print(f"record: {measure.write_record(record, a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
