"""Expert-parallel overhead on one GPU: MoEBlock through ``parallel.ep`` with expert=1 vs without.

    PYTHONPATH=src python3 benchmarks/ep_overhead.py --out DIR [--quick]     # GPU, ~2-4 min
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/ep_overhead.py --tiny  # CPU smoke run

The layer is ``moe_layer.py``'s: DeepSeek-V3's MoE layer at T = 8192 tokens,
D = 7168, F = 2048, E = 32, K = 8, one shared expert, bf16, gmm backend auto.
Cases:

* ``local``: ``MoEBlock`` without a mesh (the single-device path);
* ``ep1``: the same block with ``ExpertParallel`` on a 1x1x1x1 mesh of this
  GPU (``shard_map`` over the mesh; with one expert rank the exchange is
  skipped at trace time, so the per-rank body is the local path).

Both are timed forward and forward+backward (``jax.vjp``), interleaved
(local, ep1, local, ep1, ...) so clock drift hits both alike; the overhead is
``ep1 / local - 1`` of the medians. The compiled HLO of both is compared by
instruction count (equal counts: the same program up to the shard_map
boundary). Target: overhead within timing noise (|overhead| < 2%).

Checks recorded next to the timings:

* ``ragged_exchange``: ``jax.lax.ragged_all_to_all`` through
  ``parallel.exchange`` on a one-rank axis (outbound trip and its gradient,
  the return trip) against the expected rows, and the same for the padded
  exchange. XLA:CPU has no ragged all-to-all, so CI never runs it; this is
  where it runs.
* with more than one GPU visible, ``multi_gpu``: an expert=N float32 block
  (exchange ragged and padded) against the single-device block, output and
  input-gradient max errors, and the bf16 DeepSeek layer timed per exchange,
  with its tokens in 1 and in 2 pipeline chunks (``ep_pipeline_chunks``).

XLA runs with the flags ``dropless train`` gives a GPU by default
(``config.xla_flags.GPU_DEFAULTS``: the latency-hiding scheduler), plus
whatever ``XLA_FLAGS`` names; the record keeps the flags applied.

Writes ``<out>/ep_overhead-<time>-<gpu>.json`` (GPU, jax version, commit).
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # noqa: E402  (the layer shape and config of the MoE benchmark)

from dropless.nn.moe import MoEBlock  # noqa: E402
from dropless.parallel import ep as ep_lib  # noqa: E402
from dropless.parallel import exchange  # noqa: E402
from dropless.parallel.sharding import BATCH_AXES  # noqa: E402
from dropless.perf import hlo as hlo_lib  # noqa: E402
from dropless.perf import measure  # noqa: E402

AXES = ("data", "fsdp", "expert", "tensor")


def mesh_of(devices, expert=1) -> Mesh:
    return Mesh(np.array(devices).reshape(len(devices) // expert, 1, expert, 1), AXES)


def make_fns(block):
    """Jitted fwd(state, x) -> y and fwd_bwd(state, x, g) -> (y, grads) of ``block``."""
    graphdef, state = nnx.split(block)

    def fwd(state, x):
        return nnx.merge(graphdef, state)(x)[0]

    def fwd_bwd(state, x, g):
        y, pullback = jax.vjp(fwd, state, x)
        return y, pullback(g)

    return state, jax.jit(fwd), jax.jit(fwd_bwd)


def hlo_size(fn, *args) -> int:
    """Instructions in the optimized HLO of ``fn(*args)``."""
    return sum(1 for _ in hlo_lib.instructions(fn.lower(*args).compile().as_text()))


def overhead(shape, quick):
    """Interleaved timings of local vs ep1; returns the rows and HLO sizes."""
    cfg = moe_layer.moe_config(shape, gmm_backend="auto")
    b, s, d = shape["batch"], shape["seq"], shape["emb_dim"]
    mesh = mesh_of(jax.devices()[:1])
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=2.0, exchange="padded")
    kx, kg = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (b, s, d), jnp.bfloat16)
    g = jax.random.normal(kg, (b, s, d), jnp.bfloat16)
    cases = {}
    for name, case_ep in (("local", None), ("ep1", ep)):
        block = MoEBlock(cfg, emb_dim=d, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(0), ep=case_ep)
        cases[name] = make_fns(block)
    hlo = {name: {"fwd": hlo_size(f, st, x), "fwd_bwd": hlo_size(fb, st, x, g)}
           for name, (st, f, fb) in cases.items()}
    y_local = cases["local"][1](cases["local"][0], x)
    y_ep1 = cases["ep1"][1](cases["ep1"][0], x)
    same = bool(jnp.array_equal(y_local, y_ep1))
    rounds, iters = (2, 5) if quick else (3, 10)
    times = {(n, k): [] for n in cases for k in ("fwd", "fwd_bwd")}
    for _ in range(rounds):
        for name, (st, f, fb) in cases.items():
            times[(name, "fwd")].append(measure.time_fn(f, st, x, iters=iters)["median_ms"])
            times[(name, "fwd_bwd")].append(
                measure.time_fn(fb, st, x, g, iters=iters)["median_ms"])
    rows = []
    for kind in ("fwd", "fwd_bwd"):
        local, ep1 = (float(np.median(times[(n, kind)])) for n in ("local", "ep1"))
        rows.append({"pass": kind, "local_ms": local, "ep1_ms": ep1,
                     "overhead_pct": 100.0 * (ep1 / local - 1.0),
                     "samples_local_ms": times[("local", kind)],
                     "samples_ep1_ms": times[("ep1", kind)]})
    return rows, hlo, same


def ragged_exchange_check(impl):
    """One-rank exchange of 6 of 10 rows at offset 2 into row 3 of 12; value and gradient."""
    mesh = mesh_of(jax.devices()[:1])
    counts = jnp.array([[6]], jnp.int32)

    def per_rank(x_ND):
        trips = exchange.layouts(counts, 12, jax.lax.axis_index("expert"))
        out = trips.out._replace(input_offsets=jnp.array([2]), output_offsets=jnp.array([3]))
        back = trips.back._replace(input_offsets=jnp.array([3]), output_offsets=jnp.array([2]))
        return exchange.exchange(x_ND, 12, out, back, axis_name="expert", impl=impl,
                                 chunk_rows=10)

    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    x = jnp.arange(10 * 4, dtype=jnp.float32).reshape(10, 4)
    y = np.asarray(jax.jit(fn)(x))
    want = np.zeros((12, 4), np.float32)
    want[3:9] = np.asarray(x)[2:8]
    c = jnp.arange(12 * 4, dtype=jnp.float32).reshape(12, 4)
    gx = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(fn(x) * c)))(x))
    want_g = np.zeros((10, 4), np.float32)
    want_g[2:8] = np.asarray(c)[3:9]
    return {"impl": impl, "values_ok": bool(np.array_equal(y, want)),
            "grad_ok": bool(np.array_equal(gx, want_g))}


def multi_gpu(shape, quick, impls):
    """expert=N float32 equivalence (per exchange in ``impls``) and bf16 timings on all devices."""
    devices = jax.devices()
    n = len(devices)
    out = {"devices": n, "equivalence": [], "timing": []}
    # float32 at a size the xla gmm backend handles quickly (toy size with --tiny).
    check = shape if shape is moe_layer.TINY else {"batch": 4, "seq": 256, "emb_dim": 256,
                                                    "moe_mlp_dim": 128}
    d = check["emb_dim"]
    small = moe_layer.moe_config({**shape, "num_experts": 8 * n,
                                  "moe_mlp_dim": check["moe_mlp_dim"]}, gmm_backend="xla")
    x = jax.random.normal(jax.random.key(2), (check["batch"] * n, check["seq"], d), jnp.float32)
    ref_st, ref_f, ref_fb = make_fns(MoEBlock(small, emb_dim=d, rngs=nnx.Rngs(0)))
    y_ref, (_, gx_ref) = ref_fb(ref_st, x, x)
    for impl in impls:
        mesh = mesh_of(devices, expert=n)
        ep = ep_lib.ExpertParallel(mesh, buffer_factor=-1, exchange=impl)
        st, _, fb = make_fns(MoEBlock(small, emb_dim=d, rngs=nnx.Rngs(0), ep=ep))
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        y, (_, gx) = fb(st, xs, xs)
        out["equivalence"].append({
            "impl": impl, "max_abs_err_y": float(jnp.max(jnp.abs(y - y_ref))),
            "max_abs_err_dx": float(jnp.max(jnp.abs(gx - gx_ref)))})
    big = {**shape, "num_experts": shape["num_experts"] * n}
    bcfg = moe_layer.moe_config(big, gmm_backend="auto")
    b, s, d = shape["batch"] * n, shape["seq"], shape["emb_dim"]
    for impl in impls:
        for chunks in (1, 2):
            mesh = mesh_of(devices, expert=n)
            ep = ep_lib.ExpertParallel(mesh, buffer_factor=2.0, exchange=impl,
                                       pipeline_chunks=chunks)
            block = MoEBlock(bcfg, emb_dim=d, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0), ep=ep)
            st, f, fb = make_fns(block)
            xs = jax.device_put(jax.random.normal(jax.random.key(3), (b, s, d), jnp.bfloat16),
                                NamedSharding(mesh, P(BATCH_AXES)))
            iters = 5 if quick else 10
            out["timing"].append({
                "impl": impl, "pipeline_chunks": chunks,
                "fwd_ms": measure.time_fn(f, st, xs, iters=iters)["median_ms"],
                "fwd_bwd_ms": measure.time_fn(fb, st, xs, xs, iters=iters)["median_ms"]})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke run)")
    args = parser.parse_args(argv)
    from dropless.config.xla_flags import apply_runtime_settings, gpu_present

    # Before anything runs XLA, which reads XLA_FLAGS once per process.
    flags = apply_runtime_settings({}, {}, on_gpu=gpu_present())
    shape = moe_layer.TINY if args.tiny else moe_layer.FULL
    record = measure.new_record("ep_overhead", {"shape": shape, "quick": args.quick,
                                                "xla_flags_applied": flags})
    on_gpu = jax.devices()[0].platform == "gpu"
    impls = ("ragged", "padded") if on_gpu else ("padded",)  # XLA:CPU has no ragged all-to-all
    record["ragged_exchange"] = [ragged_exchange_check(impl) for impl in impls]
    rows, hlo, same = overhead(shape, args.quick)
    record["rows"], record["hlo_instructions"], record["outputs_identical"] = rows, hlo, same
    if jax.device_count() > 1:
        record["multi_gpu"] = multi_gpu(shape, args.quick, impls)
    path = measure.write_record(record, args.out)
    print(f"{'pass':8} {'local ms':>10} {'ep1 ms':>10} {'overhead':>9}")
    for r in rows:
        print(f"{r['pass']:8} {r['local_ms']:10.3f} {r['ep1_ms']:10.3f} {r['overhead_pct']:8.2f}%")
    print(f"HLO instructions {hlo}; outputs identical: {same}")
    print(f"exchange checks: {record['ragged_exchange']}")
    if "multi_gpu" in record:
        print(f"multi-GPU: {record['multi_gpu']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
