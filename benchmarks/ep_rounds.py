"""What ``ep_overflow_rounds`` costs: an expert-parallel MoE block with 0..n extra rounds.

    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/ep_rounds.py --out DIR   # 8 CPU devices
    PYTHONPATH=src python3 benchmarks/ep_rounds.py --out DIR                     # all local GPUs

One ``MoEBlock`` (E = 16, k = 4, D = 64, F = 64, float32, gmm backend xla)
over an expert axis of every local device (8 forced CPU devices on CPU),
jitted forward + backward, for ``ep_overflow_rounds`` in ``--rounds`` and
two loads, interleaved round-robin so drift hits all alike:

* ``fits``: random tokens with ``ragged_buffer_factor`` 2.0 (needs ~1.1):
  the extra rounds never run, so this is the cost of having them (their
  ``lax.cond`` branches, and one max over the batch axes);
* ``overflows``: every token the same, so all go to the same k experts,
  with factor 1.0: the rounds run (``ep_extra_rounds`` recorded) and
  deliver what one buffer cannot.

Records per case: compile seconds, median step milliseconds over
``--steps``, HLO text size, the compiled step's temporary memory (XLA's
memory analysis: the residuals of untaken branches are buffers too), and
the block's ``ep_extra_rounds``,
``overflow_tokens`` and ``buffer_factor_needed``. Writes
``<out>/ep_rounds-<time>-<device>.json`` (device, jax version, commit).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", default="0,1,2,4", help="comma list of ep_overflow_rounds")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case and pass")
    p.add_argument("--passes", type=int, default=3, help="round-robin passes over the cases")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dropless.config.sections import MoEConfig
    from dropless.nn.moe import MoEBlock
    from dropless.parallel import ep as ep_lib
    from dropless.parallel import mesh as mesh_lib
    from dropless.parallel import sharding
    from dropless.perf import measure

    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(1, 1, len(devices), 1), mesh_lib.MESH_AXES)
    cfg = MoEConfig(num_experts=16, num_experts_per_tok=4, moe_mlp_dim=64, gmm_backend="xla")
    spec = NamedSharding(mesh, P(sharding.BATCH_AXES))
    loads = {
        "fits": (2.0, jax.random.normal(jax.random.key(0), (len(devices), args.tokens // len(devices), 64))),
        "overflows": (1.0, jnp.ones((len(devices), args.tokens // len(devices), 64))),
    }
    cases = {}
    for load, (factor, x) in loads.items():
        x = jax.device_put(x, spec)
        for rounds in (int(r) for r in args.rounds.split(",")):
            ep = ep_lib.ExpertParallel(mesh, buffer_factor=factor, exchange="padded",
                                       overflow_rounds=rounds)
            graphdef, state = nnx.split(MoEBlock(cfg, emb_dim=64, rngs=nnx.Rngs(0), ep=ep))
            state = jax.device_put(state, sharding.state_shardings(mesh, state))

            def loss(state, x, graphdef=graphdef):
                y, stats = nnx.merge(graphdef, state)(x)
                return jnp.sum(y), stats

            t0 = time.perf_counter()
            step = jax.jit(jax.grad(loss, has_aux=True)).lower(state, x).compile()
            compile_s = time.perf_counter() - t0
            _, stats = step(state, x)
            memory = step.memory_analysis()
            temp_mib = getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory else None
            cases[(load, rounds)] = dict(temp_mib=temp_mib,
                load=load, rounds=rounds, buffer_factor=factor, compile_s=compile_s,
                hlo_kb=len(step.as_text()) // 1000, extra_rounds=int(stats.ep_extra_rounds),
                overflow_tokens=int(stats.overflow_tokens),
                buffer_factor_needed=float(stats.buffer_factor_needed),
                step=step, args=(state, x), times_ms=[])
    for _ in range(args.passes):
        for case in cases.values():
            out = case["step"](*case["args"])
            jax.block_until_ready(out)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                jax.block_until_ready(case["step"](*case["args"]))
                case["times_ms"].append((time.perf_counter() - t0) * 1e3)
    rows = []
    for case in cases.values():
        case.pop("step"), case.pop("args")
        case["step_ms"] = statistics.median(case["times_ms"])
        rows.append(case)
    base = {r["load"]: r["step_ms"] for r in rows if r["rounds"] == 0}
    print(f"{'load':10} {'rounds':>6} {'extra':>5} {'overflow':>8} {'step ms':>8} "
          f"{'vs 0':>6} {'compile s':>9} {'HLO kB':>7} {'temp MiB':>8}")
    for r in rows:
        r["vs_rounds0"] = r["step_ms"] / base[r["load"]] if r["load"] in base else None
        print(f"{r['load']:10} {r['rounds']:6d} {r['extra_rounds']:5d} {r['overflow_tokens']:8d} "
              f"{r['step_ms']:8.2f} {r['vs_rounds0'] or 0:6.2f} {r['compile_s']:9.1f} "
              f"{r['hlo_kb']:7d} {r['temp_mib'] or 0:8.1f}")
    record = measure.new_record("ep_rounds", {"tokens": args.tokens, "devices": len(devices),
                                              "steps": args.steps, "passes": args.passes,
                                              "num_experts": 16, "k": 4, "emb_dim": 64})
    record["rows"] = rows
    path = measure.write_record(record, args.out or measure.DEFAULT_RESULTS_DIR)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
