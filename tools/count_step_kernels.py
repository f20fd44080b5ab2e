"""How many Mosaic GPU kernel launches one train step makes, counted two ways.

    python tools/count_step_kernels.py model_name=deepseek3-proxy [key=value ...] [--dump=F.gz]

- ``jaxpr``: the Pallas kernel calls in the step's jaxpr, each multiplied by
  the lengths of the scans around it (runs anywhere; on CPU the config needs
  ``gmm_backend=mosaic``, which lowers but never runs here).
- ``lowered``: the ``mosaic_gpu`` custom calls in the StableHLO that JAX hands
  XLA (lowered for CUDA, so it runs anywhere too), per while loop, with the ops
  reading each result (``perf.stablehlo``): a result both stacked by a scan
  (``dynamic_update_index_in_dim``) and read by another op is one XLA's GPU
  dynamic-slice fusion runs twice (``benchmarks/notes/scan.md``).
- ``compiled`` (on a GPU, or for an H200 on a host without one where jax's CUDA plugin
  is installed, ``.venv-gpucompile``: then the whole count runs under
  ``perf.gpu_compile.gpu_view``): the ``mosaic_gpu`` custom-calls in XLA's optimized
  HLO of the step, each with its jax op name and its executions per step
  through the call graph (while loops' known trip counts multiplied, nested
  ones too); ``--dump=F.gz`` also writes that HLO text,
  so a launch count from a profile (``dropless profile``'s
  ``top_by_category.grouped_gemm[*].durations_us``) can be matched to the
  program: a difference between the two counts is XLA's doing.
"""

import gzip
import sys

import jax

from dropless.perf import gpu_compile
from dropless.perf import hlo as hlo_lib
from dropless.perf import jaxprs
from dropless.perf import stablehlo


def _kernel_calls(jaxpr, mult=1, path=""):
    """(path, executions) of each Pallas kernel call in ``jaxpr`` and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("pallas_call", "core_map", "mpmd_map") or name.startswith("pallas"):
            out.append((path or "/", mult))
            continue
        inner = mult * (eqn.params["length"] if name == "scan" else 1)
        for sub in jaxprs.sub_jaxprs(eqn):
            out += _kernel_calls(sub, inner, f"{path}/{name}")
    return out


def _compiled_calls(hlo: str) -> list[tuple[str, str, int]]:
    """(computation, op_name, executions per step) of each ``mosaic_gpu`` custom-call
    in an optimized HLO module's text.

    Executions follow the call graph from the entry (``perf.hlo.executions``): a kernel
    in a fusion inside a loop inside a loop is multiplied by both loops.
    """
    insts = list(hlo_lib.instructions(hlo))
    runs = hlo_lib.executions(insts)
    out = []
    for inst in insts:
        if "mosaic_gpu" in (inst.custom_call_target or ""):
            m = hlo_lib.OP_NAME.search(inst.attrs)
            out.append((inst.computation, m.group(1) if m else "?", runs[inst.computation]))
    return out


def lowered_for_cuda(step, *args) -> str:
    """The StableHLO text of jitted ``step`` lowered for CUDA, on any backend.

    Lowered, not exported: ``jax.export`` refuses custom calls without a
    compatibility guarantee, such as cuDNN attention's ``__cudnn$fmha*``, and this
    module is read here, never serialized.
    """
    return step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def main(argv: list[str]) -> int:
    if jax.default_backend() != "gpu" and gpu_compile.plugin_installed():
        # The H200's view on a host without a GPU (perf.gpu_compile): every count is the GPU's.
        with gpu_compile.gpu_view(gpu_compile.devices()):
            print("compiling for an H200 without a GPU (perf.gpu_compile.gpu_view)")
            return _count(argv, on_gpu=True)
    return _count(argv, on_gpu=jax.default_backend() == "gpu")


def _count(argv: list[str], on_gpu: bool) -> int:
    from dropless.config import loader
    from dropless.train import loop

    dump = next((a.split("=", 1)[1] for a in argv if a.startswith("--dump=")), None)
    argv = [a for a in argv if not a.startswith("--dump=")]
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
    for call in stablehlo.kernel_calls(lowered_for_cuda(step, state, batch)):
        where = "/".join(f"while#{i}" for i in call.loops) or "outside loops"
        print(f"lowered: in {where}, read by {', '.join(call.users) or 'nothing'}")
    if on_gpu:
        hlo = step.lower(state, batch).compile().as_text()
        if dump:
            with gzip.open(dump, "wt") as f:
                f.write(hlo)
            print(f"compiled: optimized HLO written to {dump}")
        calls = _compiled_calls(hlo)
        for comp, op_name, runs in calls:
            print(f"compiled: x{runs} in {comp}: {op_name}")
        print(f"compiled: {sum(r for _, _, r in calls)} kernel executions per step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
