"""``dropless bench [--quick] [--tiny] [--out DIR] [--only gmm,moe_layer,...]``: the benchmark matrix.

Runs, in this one process on this machine's GPU, the standard benchmarks of
``benchmarks/``: ``gmm.py`` (grouped GEMM kernels), ``moe_layer.py`` (one
DeepSeek-V3 MoE layer), ``step.py`` (training step TFLOPS/device),
``fp8_quant.py`` (the FP8 grouped GEMMs' quantization passes and kernel path),
``fp8_dense.py`` (the dense matmuls in bf16 and FP8) and ``fp8_loss.py``
(the final loss of the FP8 recipes against bf16's), in that order (gmm
first: it shares the GPU with torch, so JAX must not have preallocated
memory). Each benchmark writes its own record to ``DIR``; this
command also writes the bundle ``DIR/<YYYYmmdd-HHMMSS>-<gpu>.json`` holding
every record (or the error that stopped a benchmark), then renders the
results page: ``benchmarks/RESULTS.md`` when ``DIR`` is the default
``benchmarks/results``, else ``DIR/RESULTS.md``.

A benchmark module is called as ``run(quick=..., out_dir=...) -> record`` if
it has a ``run`` taking those, else through its ``main`` with command-line flags ``--out DIR``
(plus ``--quick``, and ``--commit SHA`` when the commit is known; flags it
rejects are dropped and it is called again), and its record is the newest
``<kind>-*.json`` it wrote. A missing or failing benchmark is reported and
the others still run.

No config code is imported, so ``PYTHONPATH=src python3 -m dropless.perf.bench``
works on a machine without pydantic.
"""

import argparse
import contextlib
import datetime
import gc
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

BENCHMARKS = ("gmm", "moe_layer", "step", "fp8_quant", "fp8_dense", "fp8_loss")


def load_module(kind: str, bench_dir: Path):
    """Import ``bench_dir/<kind>.py`` by path (benchmarks/ is not a package).

    Raises:
      FileNotFoundError: no such benchmark file.
    """
    path = bench_dir / f"{kind}.py"
    if not path.exists():
        raise FileNotFoundError(f"{kind}.py not found in {bench_dir}")
    spec = importlib.util.spec_from_file_location(f"dropless_benchmark_{kind}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _argv(args: list[str]):
    saved = sys.argv
    sys.argv = [saved[0] if saved else "bench", *args]
    try:
        yield
    finally:
        sys.argv = saved


def _call_main(main, args: list[str]) -> int:
    """``main(args)`` if it takes an argument, else ``main()`` with ``sys.argv`` set; exit code."""
    try:
        takes_args = bool(inspect.signature(main).parameters)
    except (TypeError, ValueError):
        takes_args = False
    try:
        with _argv(args):
            code = main(args) if takes_args else main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code or 0


def _newest_record(kind: str, out: Path, since: float) -> Path | None:
    files = [p for p in out.glob(f"{kind}-*.json") if p.stat().st_mtime >= since]
    return max(files, key=lambda p: p.stat().st_mtime, default=None)


# The CPU-sized mode of each benchmark (``--tiny``): a smoke run of the whole matrix.
TINY_FLAGS = {"gmm": ["--smoke"], "moe_layer": ["--tiny"], "step": ["--tiny"],
              "fp8_quant": ["--smoke"], "fp8_dense": ["--tiny"], "fp8_loss": ["--tiny"]}


def run_one(kind: str, bench_dir: Path, out: Path, quick: bool, commit: str | None,
            tiny: bool = False) -> dict:
    """Run one benchmark; its record, or ``{"error": ...}``."""
    start = time.time()
    module = load_module(kind, bench_dir)
    run = getattr(module, "run", None)
    if run is not None and not tiny and {"quick", "out_dir"} <= set(
            inspect.signature(run).parameters):
        return run(quick=quick, out_dir=out)
    if not hasattr(module, "main"):
        return {"error": f"benchmarks/{kind}.py has neither run() nor main()"}
    base = ["--out", str(out)] + (["--quick"] if quick else [])
    base += TINY_FLAGS.get(kind, ["--tiny"]) if tiny else []
    code = _call_main(module.main, base + (["--commit", commit] if commit else []))
    if code == 2 and commit:  # argparse usage error: it takes no --commit
        code = _call_main(module.main, base)
    path = _newest_record(kind, out, start)
    if path is None:
        return {"error": f"benchmarks/{kind}.py exited with {code} and wrote no {kind}-*.json"}
    record = json.loads(path.read_text())
    record.setdefault("path", str(path))
    if code:
        record["exit_code"] = code
    return record


def _free_memory():
    import jax

    gc.collect()
    jax.clear_caches()


def run_all(kinds, bench_dir: Path, out: Path, quick: bool, tiny: bool = False) -> dict:
    """Run ``kinds`` in order; returns the bundle (not yet written)."""
    from dropless.perf import measure

    bundle = measure.new_record("bench", {"quick": quick, "tiny": tiny, "benchmarks": list(kinds)})
    bundle.update(records={}, seconds={})
    commit = bundle["commit"]["commit"]
    commit = None if commit == "unknown" else commit
    for kind in kinds:
        t0 = time.perf_counter()
        print(f"=== {kind} ===", flush=True)
        try:
            bundle["records"][kind] = run_one(kind, bench_dir, out, quick, commit, tiny)
        except Exception as e:  # noqa: BLE001 - report it, run the other benchmarks
            traceback.print_exc()
            bundle["records"][kind] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        bundle["seconds"][kind] = time.perf_counter() - t0
        _free_memory()
    return bundle


def summary_table(bundle: dict):
    """A rich table: one line per benchmark with its status, time and headline."""
    from rich.table import Table

    from dropless.perf import report

    table = Table(title=f"dropless bench on {bundle['device']['gpu']} "
                        f"(commit {str(bundle['commit']['commit'])[:12]})")
    for col in ("benchmark", "status", "seconds", "headline"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for kind, record in bundle["records"].items():
        error = record.get("error")
        status = f"[red]{error[:70]}[/]" if error else "ok"
        headline = "" if error else "; ".join(report.headlines(kind, record))
        table.add_row(kind, status, f"{bundle['seconds'][kind]:.0f}", headline)
    return table


def main(args: list[str] | None = None) -> int:
    """Entry point of ``dropless bench``; exit code 1 if any benchmark failed."""
    from dropless.perf.measure import DEFAULT_RESULTS_DIR, REPO_ROOT

    parser = argparse.ArgumentParser(prog="dropless bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, cases and samples")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU-sized smoke run of every benchmark (gmm --smoke, others --tiny); "
                             "checks the matrix end to end, measures nothing")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR,
                        help="results directory (default benchmarks/results)")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--md", type=Path, default=None, help="results page to render (default "
                        "benchmarks/RESULTS.md with the default --out, else OUT/RESULTS.md)")
    parser.add_argument("--benchmarks-dir", type=Path, default=REPO_ROOT / "benchmarks",
                        help="where the benchmark scripts are (default the repository's benchmarks/)")
    ns = parser.parse_args(sys.argv[1:] if args is None else args)
    kinds = [k for k in ns.only.split(",") if k]
    if unknown := sorted(set(kinds) - set(BENCHMARKS)):
        parser.error(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
    # Before JAX starts: torch (in the gmm benchmark) needs GPU memory too.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from rich.console import Console

    from dropless.perf import measure, report

    ns.out.mkdir(parents=True, exist_ok=True)
    bundle = run_all(kinds, ns.benchmarks_dir, ns.out, ns.quick, ns.tiny)
    created = datetime.datetime.fromisoformat(bundle["created"])
    path = ns.out / f"{created:%Y%m%d-%H%M%S}-{bundle['device']['slug']}.json"
    path.write_text(json.dumps(bundle, indent=1, default=measure._jsonable) + "\n")
    md = ns.md or (REPO_ROOT / "benchmarks" / "RESULTS.md"
                   if ns.out.resolve() == DEFAULT_RESULTS_DIR.resolve() else ns.out / "RESULTS.md")
    report.render(ns.out, md)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(f"wrote {path} and {md}")
    console.print(summary_table(bundle))
    return 1 if any("error" in r for r in bundle["records"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
