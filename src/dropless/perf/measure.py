"""Benchmark plumbing: device-synchronised timing and results records.

Every benchmark in ``benchmarks/`` writes one JSON *record* per run to
``benchmarks/results/<kind>-<YYYYmmdd-HHMMSS>-<gpu>.json``. A record is a dict::

    {
      "kind": "gmm" | "moe_layer" | "step" | ...,
      "created": "2026-11-29T09:04:11+00:00",          # UTC, ISO 8601
      "device": {"platform": "gpu", "gpu": "NVIDIA H200", "count": 1, "slug": "nvidia-h200"},
      "versions": {"jax": "0.11.2", "jaxlib": "0.11.2", "python": "3.12.3", ...},
      "commit": {"commit": "<sha>", "dirty": false, "source": "git" | "env" | "unknown"},
      "source_digest": "sha256:<hex>",                  # the code that ran (``provenance``)
      "config": {...},                                  # what was measured
      "rows": [{...}, ...],                             # the measurements
      ...                                               # kind-specific extras
    }

``new_record`` fills the provenance fields; ``report.py`` renders only
records that carry them. The commit comes from the ``DROPLESS_COMMIT``
environment variable when it is set (copies of the tree on a remote GPU
machine, whose ``.git`` may be absent or stale), else from ``git``.

This module imports no config code (no pydantic), so benchmarks run with a
bare ``PYTHONPATH=src python3``.
"""

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dropless.perf.provenance import REPO_ROOT, source_digest
DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def slug(text: str) -> str:
    """File-name-safe lowercase form: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_info() -> dict:
    """Platform, device kind (e.g. 'NVIDIA H200'), device count and a file-name slug."""
    import jax

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "") or dev.platform
    return {"platform": dev.platform, "gpu": kind, "count": jax.device_count(), "slug": slug(kind)}


def versions() -> dict:
    """Versions of the libraries a benchmark number depends on."""
    import jax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "python": platform.python_version()}
    for name in ("flax", "numpy", "torch"):
        # torch only when a benchmark already imported it: it is slow to import.
        mod = sys.modules.get(name)
        if mod is None and name != "torch":
            try:
                mod = __import__(name)
            except ImportError:
                mod = None
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    try:
        out["platform_version"] = jax.extend.backend.get_backend().platform_version
    except Exception:  # noqa: BLE001 - informative only (e.g. the CUDA driver/runtime string)
        pass
    return out


def git_commit(repo: Path = REPO_ROOT) -> dict:
    """{'commit', 'dirty', 'source'}: $DROPLESS_COMMIT if set, else git, else 'unknown'."""
    env = os.environ.get("DROPLESS_COMMIT", "").strip()
    if env:
        return {"commit": env, "dirty": None, "source": "env"}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=repo, capture_output=True, text=True, check=True,
                                timeout=10).stdout
        return {"commit": sha, "dirty": bool(status.strip()), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": "unknown", "dirty": None, "source": "unknown"}


def commit_label() -> str:
    """``git_commit``'s commit as one string, "-dirty" appended for a dirty tree."""
    info = git_commit()
    return info["commit"] + ("-dirty" if info["dirty"] else "")


def now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


def new_record(kind: str, config: dict | None = None) -> dict:
    """A results record with provenance filled in and empty ``rows``."""
    return {"kind": kind, "created": now_utc().isoformat(), "device": device_info(),
            "versions": versions(), "commit": git_commit(), "source_digest": source_digest(),
            "config": dict(config or {}), "rows": []}


def write_record(record: dict, out_dir: str | os.PathLike = DEFAULT_RESULTS_DIR,
                 name: str | None = None) -> Path:
    """Write ``record`` as ``<out_dir>/<name>``, atomically; return the path. ``name``
    defaults to ``<kind>-<YYYYmmdd-HHMMSS>-<gpu slug>.json`` (``new_record``'s fields).

    Raises:
      KeyError: no ``name`` and the record lacks "kind", "created" or "device".
    """
    if name is None:
        created = datetime.datetime.fromisoformat(record["created"])
        name = f"{record['kind']}-{created:%Y%m%d-%H%M%S}-{record['device']['slug']}.json"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    tmp = path.with_suffix(".json.tmp")  # a run cut mid-write leaves the previous record whole
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _jsonable(x):
    # numpy / jax scalars and arrays that slipped into a record.
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def time_fn(fn, *args, warmup: int = 2, iters: int = 10, reps: int | None = None,
            sample_ms: float = 20.0, max_reps: int = 20) -> dict:
    """Device-synchronised wall time of ``fn(*args)``, in milliseconds.

    Each of ``iters`` samples times ``reps`` back-to-back calls followed by
    ``jax.block_until_ready`` and divides by ``reps``: with reps > 1 the
    device queue stays full, so launch gaps between calls do not count.
    ``warmup`` calls (compilation, autotuning, allocator growth) come first.
    ``reps=None`` picks enough reps for a sample to last about ``sample_ms``
    (at most ``max_reps``), from one timed call after the warm-up.

    Returns:
      {"median_ms", "min_ms", "max_ms", "iters", "reps", "samples_ms"}.

    Raises:
      ValueError: iters or reps < 1.
    """
    import jax

    if iters < 1 or (reps is not None and reps < 1):
        raise ValueError(f"{iters=} and {reps=} must be >= 1")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if reps is None:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once_ms = (time.perf_counter() - t0) * 1e3
        reps = int(min(max_reps, max(1, sample_ms // max(once_ms, 1e-3))))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / reps)
        del out
    return {"median_ms": statistics.median(samples), "min_ms": min(samples),
            "max_ms": max(samples), "iters": iters, "reps": reps, "samples_ms": samples}


# CUPTI's measure holds every iteration's outputs until it returns; this bounds them.
CUPTI_LIVE_BYTES = 16 * 2**30


def cupti_kernel_ms(fn, *args, iters: int = 10, max_live_bytes: int = CUPTI_LIVE_BYTES) -> list:
    """Per-call device kernel time of ``fn(*args)`` in milliseconds, from CUPTI (the sum
    of the kernels one call launches; ``jax.experimental.mosaic.gpu.profiler``).

    The profiler runs its iterations back to back and keeps all their outputs alive
    until it returns, so at [256, 7168, 2048] (a 7.5 GB gradient) ten iterations ask
    for 75 GB on top of the operands; JAX's allocator then waits instead of failing.
    Here the iterations run in chunks whose outputs together stay under
    ``max_live_bytes`` (at least one call per chunk), so small outputs keep one
    back-to-back chunk as before. No warm-up: call ``fn`` once first.

    Returns:
      ``iters`` per-call times (take the median).

    Raises:
      ValueError: ``iters`` < 1.
      RuntimeError: the default backend is not a GPU. (Off the GPU the profiler
        still runs the function and tries to start CUPTI; on a CPU host a
        Pallas interpret-mode kernel run after that attempt never finished.)
      Whatever the profiler raises where CUPTI is unavailable.
    """
    import jax

    if iters < 1:
        raise ValueError(f"{iters=} must be >= 1")
    if jax.default_backend() != "gpu":
        raise RuntimeError(f"CUPTI times GPU kernels; the backend is {jax.default_backend()}")
    from jax.experimental.mosaic.gpu import profiler

    out_bytes = sum(a.size * a.dtype.itemsize
                    for a in jax.tree.leaves(jax.eval_shape(fn, *args)))
    chunk = int(max(1, min(iters, max_live_bytes // max(out_bytes, 1))))
    times = []
    while len(times) < iters:
        n = min(chunk, iters - len(times))
        _, t = profiler.measure(fn, iterations=n)(*args)
        if t is None:
            raise RuntimeError("CUPTI timed no kernel launch of the function")
        times.extend([t] if n == 1 else t)
    return times


def profile_calls(fn, *args, calls: int = 3, log_dir: str | os.PathLike | None = None):
    """Kernel-time breakdown of ``calls`` calls of ``fn(*args)``, each traced as one step.

    ``fn`` should already be compiled (time it first). The trace goes to
    ``log_dir``, or to a temporary directory that is removed afterwards.

    Returns:
      ``breakdown.Breakdown`` of the traced calls.
    """
    import shutil
    import tempfile

    import jax

    from dropless.perf import breakdown, trace

    tmp = None if log_dir is not None else tempfile.mkdtemp(prefix="dropless-profile-")
    out = Path(log_dir if log_dir is not None else tmp)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    try:
        jax.block_until_ready(fn(*args))
        with jax.profiler.trace(str(out), profiler_options=options):
            for i in range(calls):
                with jax.profiler.StepTraceAnnotation("call", step_num=i):
                    result = fn(*args)
                jax.block_until_ready(result)
                del result
        return breakdown.compute(trace.load_trace(out))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
