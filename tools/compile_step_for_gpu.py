"""The trainer's step as XLA:GPU compiles it for an H200, on a host without a GPU.

    JAX_PLATFORMS=cpu .venv-gpucompile/bin/python tools/compile_step_for_gpu.py \
        model_name=deepseek3-proxy [key=value ...] [--out F.hlo.txt.gz] [--dump DIR]
    .venv-gpucompile/bin/python tools/compile_step_for_gpu.py --summarize F.hlo.txt.gz

The step is ``dropless train``'s own (``loader.load_config`` with ``dataset_type=synthetic``
first, ``loop._setup``, ``loop._jit_step``; the config's XLA flags and environment as
``dropless train`` applies them on a GPU), traced and compiled under
``perf.gpu_compile.gpu_view``: the mesh lies on the compile-only H200 of jax's CUDA plugin,
and every probe of the device (the FP8 kernels' Hopper check, the persistent grids' SM count,
cuDNN attention's version and compute-capability checks) answers as there. Needs
``make gpu-compile-venv``. The deepseek3-proxy step takes about a minute on two cores.

Differences from the H200's own compile: nothing is autotuned (each cuBLAS call keeps
algorithm 0, the bf16 GEMMs stay Triton fusions where the autotuner could pick cuBLAS),
sorts take XLA's fallback (no CUB scratch sizes without a device), and cuDNN's calls carry
no workspace. The FP8 GEMM calls, the fusions around them and the Mosaic GPU calls are the
GPU's.

Prints counts read off the optimized HLO (``summarize``), per run of the step (a while loop's
body once per iteration, so a scan's layers count each): the cuBLASLt FP8 GEMM calls by
output dtype, the fusions that only convert a cuBLAS GEMM's result to bf16, the Mosaic GPU
and cuDNN calls, the copies, the kernels (instructions that launch work), the while loops.
"""

import argparse
import collections
import gzip
import os
import sys
import time
from pathlib import Path


def _computations(insts):
    by_comp = collections.defaultdict(list)
    for inst in insts:
        by_comp[inst.computation].append(inst)
    return by_comp


def summarize(text: str) -> dict:
    """Counts of optimized HLO text (module docstring), per run of the step: an instruction
    in a while loop's body counts once per iteration (``perf.hlo.executions``), so a scanned
    model's counts are its layers' too. A convert-only fusion: a ``kLoop`` fusion reading a
    cuBLAS call's result (its get-tuple-element) whose fused computation holds only
    parameters, converts and bitcasts. ``kernels``: the instructions outside fusions that
    launch work (fusions, custom calls, copies, ...; not bookkeeping, control flow or the
    loops' conditions)."""
    from dropless.perf import hlo

    insts = list(hlo.instructions(text))
    runs = hlo.executions(insts)
    by_comp = _computations(insts)
    targets = collections.Counter()
    for i in insts:
        if i.opcode == "custom-call":
            targets[i.custom_call_target] += runs[i.computation]
    gemms = {(i.computation, i.name): i for i in insts
             if (i.custom_call_target or "").startswith("__cublas$")}
    fp8 = [i for i in gemms.values() if i.custom_call_target == "__cublas$lt$matmul$f8"]
    out_dtypes = collections.Counter()
    for i in fp8:
        out_dtypes[i.result_types[0].split("[")[0]] += runs[i.computation]
    results = {(i.computation, i.name): gemms[(i.computation, i.operands[0][1])] for i in insts
               if i.opcode == "get-tuple-element" and (i.computation, i.operands[0][1]) in gemms}
    convert_only = collections.Counter()
    for i in insts:
        if i.opcode != "fusion" or "kind=kLoop" not in i.attrs:
            continue
        read = [results[(i.computation, name)] for _, name in i.operands
                if (i.computation, name) in results]
        called = [c for key, c in hlo.callees(i) if key == "calls"]
        ops = {j.opcode for c in called for j in by_comp.get(c, [])}
        if read and ops and ops <= {"parameter", "convert", "bitcast"}:
            kind = "after an FP8 GEMM" if any(g in fp8 for g in read) else "after a bf16 GEMM"
            convert_only[kind] += runs[i.computation]
    launches = hlo.launches(insts)
    return {
        "fp8_gemm_calls": sum(runs[i.computation] for i in fp8),
        "fp8_gemm_output_dtypes": dict(out_dtypes),
        "convert_only_fusions": dict(convert_only),
        "mosaic_gpu_calls": sum(n for t, n in targets.items() if t and "mosaic_gpu" in t),
        "cudnn_calls": sum(n for t, n in targets.items() if t and "cudnn" in t),
        "copies": sum(runs[i.computation] for i in insts if i.opcode in ("copy", "copy-start")),
        "kernels": sum(runs[i.computation] for i in launches),
        "while_loops": sum(1 for i in insts if i.opcode == "while"),
    }


def compile_step(overrides: list[str], dump: Path | None = None) -> tuple[str, dict]:
    """(optimized HLO text, {"seconds": taken, "xla_flags": those applied}) of the trainer's
    step for ``overrides``, compiled for an H200 (``perf.dry_run.compile_for``, as
    ``train --dry-run --compile-for h200``)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dropless.config import loader
    from dropless.config.xla_flags import apply_runtime_settings
    from dropless.perf import dry_run

    cfg = loader.load_config(None, ["dataset_type=synthetic", *overrides]).config
    if dump:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    applied = apply_runtime_settings(cfg.xla_flags, cfg.env, on_gpu=True)  # before XLA starts
    start = time.perf_counter()
    text = dry_run.compile_for(cfg, "h200").as_text()
    return text, {"seconds": time.perf_counter() - start, "xla_flags": " ".join(applied)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config key=value ...")
    p.add_argument("--out", type=Path, default=None, help="write the HLO text here (.gz: gzipped)")
    p.add_argument("--dump", type=Path, default=None, help="XLA's dump folder (--xla_dump_to)")
    p.add_argument("--summarize", type=Path, default=None,
                   help="only print the counts of an HLO text file written before (.gz ok)")
    a = p.parse_args(argv)
    if a.summarize:
        if not a.summarize.is_file():
            print(f"error: {a.summarize} is not a file", file=sys.stderr)
            return 2
        with (gzip.open if a.summarize.suffix == ".gz" else open)(a.summarize, "rt") as f:
            text = f.read()
        timings = {}
    else:
        from dropless.config.loader import ConfigError
        from dropless.perf.gpu_compile import NoCudaPlugin

        try:
            text, timings = compile_step(a.overrides, a.dump)
        except (ConfigError, NoCudaPlugin) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if a.out:
            with (gzip.open if a.out.suffix == ".gz" else open)(a.out, "wt") as f:
                f.write(text)
            print(f"wrote {a.out}")
    rounded = {k: round(v, 1) if isinstance(v, float) else v for k, v in timings.items()}
    for key, value in {**summarize(text), **rounded}.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
