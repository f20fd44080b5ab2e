"""Capture a small real profiler trace for the categoriser tests.

One command per platform; the result is committed under ``tests/perf/fixtures``:

    # on the GPU machine (a few seconds after start-up):
    PYTHONPATH=src python3 benchmarks/capture_trace_fixture.py --out $OUT
    # here, on CPU:
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/capture_trace_fixture.py --out tests/perf/fixtures

Each step of the trace runs, under ``jax.profiler.StepTraceAnnotation``:
a tiny MoE layer forward+backward (``MoEBlock``, gmm backend ``auto``, and on a
GPU also ``xla``, so both our kernels and XLA's ragged_dot appear), a dense
bf16 matmul, cuDNN flash attention when the GPU takes it, a host->device and a
device->host copy. It writes ``<platform>_trace.json.gz`` (the trace, with the
host events the parser never reads dropped to keep it to a few hundred KB) and
``<platform>_trace.meta.json`` (what ran: the tests expect exactly those
categories), then prints the breakdown.
"""

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dropless.config.sections import MoEConfig
from dropless.nn.moe import MoEBlock
from dropless.ops.gmm import resolve_backend
from dropless.perf import breakdown, measure, trace

# Small enough to trace in seconds, big enough for real GEMM kernels.
BATCH, SEQ, EMB, MLP_DIM, EXPERTS, TOP_K = 2, 128, 256, 128, 8, 2


def moe_step_fn(backend: str):
    """A jitted fwd+bwd of a tiny bf16 MoE layer on ``backend``; returns (fn, args)."""
    cfg = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_mlp_dim=MLP_DIM,
                    shared_experts=1, routed_score_func="sigmoid", gmm_backend=backend)
    block = MoEBlock(cfg, emb_dim=EMB, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                     rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32)) + stats.aux_loss

    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, EMB), jnp.bfloat16)
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def attention_fn():
    """cuDNN flash attention (GPU only), or None when this device does not take it."""
    q = jax.random.normal(jax.random.key(2), (2, 256, 4, 64), jnp.bfloat16)
    fn = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True,
                                                        implementation="cudnn"))
    try:
        jax.block_until_ready(fn(q))
    except Exception as e:  # noqa: BLE001 - any failure means "not on this device"
        print(f"cuDNN attention not captured: {type(e).__name__}: {str(e)[:120]}")
        return None
    return lambda: fn(q)


def build_workload(platform: str):
    """The per-step callables and the metadata the tests check against."""
    auto = resolve_backend("auto", (BATCH * SEQ * TOP_K, EMB), (EXPERTS, EMB, 2 * MLP_DIM),
                           jnp.bfloat16)
    backends = [auto] + (["xla"] if platform == "gpu" and auto != "xla" else [])
    work, ran = [], []
    for backend in backends:
        try:
            fn, args = moe_step_fn(backend)
            jax.block_until_ready(fn(*args))  # compile now: a backend that fails is left out
        except Exception as e:  # noqa: BLE001 - the fixture records what actually ran
            print(f"gmm backend {backend} not captured: {type(e).__name__}: {str(e)[:200]}")
            continue
        ran.append(backend)
        work.append(lambda fn=fn, args=args: fn(*args))
    a = jax.random.normal(jax.random.key(3), (1024, 1024), jnp.bfloat16)
    matmul = jax.jit(lambda a: a @ a)
    work.append(lambda: matmul(a))
    attn = attention_fn() if platform == "gpu" else None
    if attn is not None:
        work.append(attn)
    host = np.ones((512, 1024), np.float32)  # 2 MiB each way

    def copies():
        on_device = jax.device_put(host)
        return np.asarray(jax.device_get(on_device + 1))

    work.append(copies)
    meta = {"platform": platform, "gmm_backends": ran, "attention": attn is not None,
            "dense_matmul": True, "host_device_copies": platform == "gpu",
            "communication": False}
    return work, meta


def keep_event(e: dict, lanes: set) -> bool:
    """Whether the fixture keeps a trace event: metadata, kernels, copies and step markers."""
    if e.get("ph") == "M":
        return True
    args = e.get("args", {})
    return ((e.get("pid"), e.get("tid")) in lanes or "hlo_op" in args or "step_num" in args)


def capture(out: Path, steps: int) -> tuple[Path, dict]:
    """Run the workload under the profiler and write the trimmed fixture; returns (path, meta)."""
    platform = jax.devices()[0].platform
    work, meta = build_workload(platform)
    for fn in work:  # compile and warm up outside the trace
        jax.block_until_ready(fn())
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    tmp = Path(tempfile.mkdtemp(prefix="dropless-trace-"))
    try:
        with jax.profiler.trace(str(tmp), profiler_options=options):
            for i in range(steps):
                with jax.profiler.StepTraceAnnotation("fixture", step_num=i):
                    outs = [fn() for fn in work]
                jax.block_until_ready(outs)
        events = trace.read_events(trace.find_trace_file(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    procs, threads = trace._names(events)
    lanes = trace._gpu_lanes(procs, threads)
    kept = [e for e in events if keep_event(e, lanes)]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{platform}_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": kept}, f)
    meta.update(steps=steps, device=measure.device_info(), versions=measure.versions(),
                events_kept=len(kept), events_total=len(events))
    with open(out / f"{platform}_trace.meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    return path, meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/perf/fixtures"))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    path, meta = capture(args.out, args.steps)
    bd = breakdown.compute(trace.load_trace(path))
    breakdown.print_breakdown(bd)
    size_kb = path.stat().st_size / 1024
    print(f"wrote {path} ({size_kb:.0f} KB, {meta['events_kept']} of {meta['events_total']} "
          f"events kept), meta: {json.dumps({k: meta[k] for k in ('gmm_backends', 'attention')})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
