"""How many Mosaic GPU kernel launches one train step makes, counted two ways.

    python tools/count_step_kernels.py model_name=deepseek3-proxy [key=value ...]

- ``jaxpr``: the Pallas kernel calls in the step's jaxpr, each multiplied by
  the lengths of the scans around it (runs anywhere; on CPU the config needs
  ``gmm_backend=mosaic``, which lowers but never runs here).
- ``compiled`` (GPU only): the ``mosaic_gpu`` custom-calls in XLA's optimized
  HLO of the step, per computation, with each while loop's known trip count,
  so a launch count from a profile (``dropless profile``'s
  ``top_by_category.grouped_gemm[*].durations_us``) can be matched to the
  program: a difference between the two counts is XLA's doing.
"""

import re
import sys

import jax

from dropless.perf import hlo as hlo_lib


def _kernel_calls(jaxpr, mult=1, path=""):
    """(path, executions) of each Pallas kernel call in ``jaxpr`` and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("pallas_call", "core_map", "mpmd_map") or name.startswith("pallas"):
            out.append((path or "/", mult))
            continue
        inner = mult * (eqn.params["length"] if name == "scan" else 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _kernel_calls(sub, inner, f"{path}/{name}")
    return out


def _compiled_counts(hlo: str) -> dict[str, int]:
    """Mosaic custom-calls per computation of an optimized HLO module's text."""
    counts = {}
    for inst in hlo_lib.instructions(hlo):
        if "mosaic_gpu" in (inst.custom_call_target or ""):
            counts[inst.computation] = counts.get(inst.computation, 0) + 1
    return counts


def _loop_trips(hlo: str) -> dict[str, int]:
    """Each while loop's body computation and its known trip count (1 where XLA knows none)."""
    trips = {}
    for inst in hlo_lib.instructions(hlo):
        body = re.search(r"\bbody=%?([\w.\-]+)", inst.attrs) if inst.opcode == "while" else None
        if body:
            n = re.search(r'known_trip_count[^0-9]*(\d+)', inst.attrs)
            trips[body.group(1)] = int(n.group(1)) if n else 1
    return trips


def main(argv: list[str]) -> int:
    from dropless.config import loader
    from dropless.train import loop

    cfg = loader.load_config(None, ["dataset_type=synthetic", *argv]).config
    s = loop._setup(cfg.model(), cfg.train(), cfg.mesh())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s.abstract)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s.feed.local(0))
    step = loop._jit_step(s)
    calls = _kernel_calls(jax.make_jaxpr(step)(state, batch).jaxpr)
    by_path = {}
    for path, mult in calls:
        by_path[(path, mult)] = by_path.get((path, mult), 0) + 1
    for (path, mult), n in sorted(by_path.items()):
        print(f"jaxpr: {n} call(s) x {mult} at {path}")
    print(f"jaxpr: {sum(m for _, m in calls)} kernel executions per step")
    if jax.default_backend() == "gpu":
        hlo = step.lower(state, batch).compile().as_text()
        trips, total = _loop_trips(hlo), 0
        for comp, n in _compiled_counts(hlo).items():
            runs = trips.get(comp, 1)
            total += n * runs
            print(f"compiled: {n} mosaic custom-call(s) in {comp}"
                  + (f", a while body run {runs} times" if comp in trips else ""))
        print(f"compiled: {total} kernel executions per step (loops nested in loops not multiplied)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
