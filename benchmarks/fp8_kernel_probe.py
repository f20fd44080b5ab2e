"""The FP8 blockwise kernels alone: tile-order and pipeline variants, and one call for a profiler.

Legend: M rows, K x N the weight dims (w [G, K, N]), G groups.

Sweep mode (default) times the forward and dgrad kernel
(``mosaic_fp8.gmm_fp8_blockwise``) and the wgrad kernel
(``mosaic_fp8_tgmm.tgmm_fp8_blockwise``) on codes and scales prepared
outside the timing (random data, balanced groups), over the variants in
``VARIANTS``, with CUPTI kernel time (median) and the wall-clock time of the
jitted call, and writes a ``fp8_kernels`` record. ``--once VARIANT`` runs the
forward kernel three times and exits: the run to put under Nsight Compute
(``ncu --launch-skip 2 --launch-count 1 -k regex:mosaic``).

  PYTHONPATH=src python3 benchmarks/fp8_kernel_probe.py [--shape M,G,K,N] [--out DIR]
"""

import argparse
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dropless.ops.gmm import mosaic_fp8, mosaic_fp8_tgmm  # noqa: E402
from dropless.perf import measure  # noqa: E402

# name -> keyword arguments of gmm_fp8_blockwise
VARIANTS = {
    "cols_gtw1": dict(split="columns", grid_tile_width=1),
    "rows_gtw8": dict(split="rows", grid_tile_width=8),
    "rows_gtw4": dict(split="rows", grid_tile_width=4),
    "rows_gtw8_s3": dict(split="rows", grid_tile_width=8, num_stages=3),
}


def cupti_ms(fn, args, iters):
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, times = profiler.measure(fn, iterations=iters)(*args)
    return statistics.median(times)


def operands(m, g, k, n):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    gs = jnp.full((g,), m // g, jnp.int32)
    wq, sw = mosaic_fp8.quantize_weight(w)
    ops = {"fwd": mosaic_fp8.fwd_operands(x, wq, sw), "dgrad": mosaic_fp8.dgrad_operands(dy, wq, sw),
           "wgrad": mosaic_fp8_tgmm.wgrad_operands(x, dy)}
    return jax.block_until_ready(ops), gs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="65536,32,7168,4096", help="M,G,K,N")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--once", metavar="VARIANT", help="run the fwd kernel 3 times and exit")
    p.add_argument("--product", default="fwd", choices=["fwd", "dgrad", "wgrad"])
    p.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    a = p.parse_args(argv)
    m, g, k, n = map(int, a.shape.split(","))
    ops, gs = operands(m, g, k, n)
    if a.once:
        if a.product == "wgrad":
            f = jax.jit(lambda o: mosaic_fp8_tgmm.tgmm_fp8_blockwise(*o, gs))
        else:
            f = jax.jit(lambda o: mosaic_fp8.gmm_fp8_blockwise(*o, gs, **VARIANTS[a.once]))
        for _ in range(3):
            jax.block_until_ready(f(ops[a.product]))
        return 0
    flops = 2 * m * k * n
    record = measure.new_record("fp8_kernels", {"M": m, "G": g, "K": k, "N": n,
                                                "layout": "balanced", "iters": a.iters,
                                                "variants": VARIANTS})
    print(f"{'variant':<12} {'product':<6} {'kernel ms':>9} {'wall ms':>8} {'TF/s kern':>9} "
          f"{'TF/s wall':>9}")
    jobs = [(v, prod) for v in a.variants.split(",") for prod in ("fwd", "dgrad")]
    # wgrad with float32 output (the probe's earlier records) and with bf16, what
    # training writes for bf16 weights (half the output bytes).
    jobs += [(f"wgrad_{sp}{dt}", "wgrad") for sp in mosaic_fp8_tgmm.SPLITS for dt in ("", "_bf16")]
    for v, prod in jobs:
        if prod == "wgrad":
            f = jax.jit(lambda o, sp=v.split("_")[1], dt=(jnp.bfloat16 if v.endswith("_bf16")
                                                          else jnp.float32):
                        mosaic_fp8_tgmm.tgmm_fp8_blockwise(*o, gs, split=sp, out_dtype=dt))
        else:
            f = jax.jit(lambda o, kw=VARIANTS[v]: mosaic_fp8.gmm_fp8_blockwise(*o, gs, **kw))
        try:
            kms = cupti_ms(f, (ops[prod],), a.iters)
            wms = measure.time_fn(f, ops[prod], iters=a.iters)["median_ms"]
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            print(f"{v:<12} {prod:<6} failed: {type(e).__name__}: {str(e)[:200]}")
            record["rows"].append({"variant": v, "product": prod, "error": str(e)[:500]})
            continue
        row = {"variant": v, "product": prod, "kernel_ms": kms, "wall_ms": wms,
               "tflops_kernel": flops / kms / 1e9, "tflops_wall": flops / wms / 1e9}
        record["rows"].append(row)
        print(f"{v:<12} {prod:<6} {kms:>9.3f} {wms:>8.3f} {row['tflops_kernel']:>9.0f} "
              f"{row['tflops_wall']:>9.0f}")
    # Every variant computes each output element from the same wgmma steps in the
    # same order, so the results must agree bit for bit with the first variant.
    names = a.variants.split(",")
    for prod in ("fwd", "dgrad"):
        outs = {v: np.asarray(mosaic_fp8.gmm_fp8_blockwise(*ops[prod], gs, **VARIANTS[v])
                              .astype(jnp.float32)) for v in names}
        for v in names[1:]:
            same = bool(np.array_equal(outs[v], outs[names[0]]))
            record["rows"].append({"variant": v, "product": prod, "bitwise_equal_to": names[0],
                                   "equal": same})
            print(f"{prod} {v} == {names[0]}: {same}")
    outs = [np.asarray(mosaic_fp8_tgmm.tgmm_fp8_blockwise(*ops["wgrad"], gs, split=sp))
            for sp in mosaic_fp8_tgmm.SPLITS]
    same = bool(np.array_equal(*outs))
    record["rows"].append({"variant": "wgrad_rows", "product": "wgrad",
                           "bitwise_equal_to": "wgrad_columns", "equal": same})
    print(f"wgrad rows == columns: {same}")
    print(f"record: {measure.write_record(record, a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
