"""Where a checkpoint save's time goes: copies of the train state to host beside a compute loop.

    PYTHONPATH=src python3 benchmarks/ckpt_transfer.py [--out DIR] [--dir /tmp] [KEY=VALUE ...]   # GPU
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/ckpt_transfer.py --tiny                # CPU smoke

The state is the train state of ``model_name=deepseek3-proxy`` (``--tiny``:
``deepseek3-tiny``; config overrides after the flags), built abstractly by the
trainer's own init and filled on one device with hashed values of the
init's std (integers zero). Phases, in this order (``--phases`` picks a
subset):

  host            first-touch writes of fresh host pages and copies between
                  touched ones, numpy on one thread (up to 4 GiB): the host
                  side a pageable device-to-host copy must do
  snapshot        ``checkpoint.snapshot``, the jitted on-device copy of
                  ``checkpoint_device_snapshot`` (compiled first)
  device_get      ``jax.device_get`` of the state into pageable numpy, alone,
                  then again beside the loop
  pinned          ``jax.device_put`` to ``pinned_host`` memory: the first
                  (cold: XLA's pinned pool grows) beside the loop, then warm
                  alone, the warm result to numpy, and warm beside the loop
  orbax_pageable  an Orbax save of the state through a ``CheckpointManager``
                  configured as ``checkpoint.Checkpointer``'s with pageable
                  copies, called from a thread beside the loop: until the save
                  call returns (the copy to host) and until the write ends
  orbax_pinned    the same with Orbax's pinned copies; after ``pinned`` in the
                  same run its pool is warm (the row's ``pool_warm``), without
                  it cold, as at a training run's first save

Beside a copy the main thread runs a fixed jitted compute loop (a chain of
bf16 [n, n] matmuls, calibrated to ``--target-ms`` per iteration) in chunks of
``--chunk`` iterations, cycling three modes: ``none`` (dispatch the chunk,
wait for its end), ``put`` (a batch-sized host array put on the device each
iteration, as the training loop puts its batch) and ``fetch`` (a scalar
fetched to host after each iteration, as the loop fetches its metrics). The
same loop alone, before the first phase and after the last, is the baseline.
Against it: ``none`` slower means the copy slows the GPU's compute; only
``fetch`` (or ``put``) slower means the loop's small transfers queue behind
the copy; a slower dispatch means the host thread is held (launches, GIL).

Each phase's seconds and GB/s (decimal GB of the state's bytes) go into
``<out>/ckpt_transfer-<time>-<gpu>.json``, rewritten after each phase
(``"partial": true`` until the last), with every loop sample. The Orbax
checkpoints go under a fresh directory in ``--dir`` and are deleted after
each save; the free disk space and host memory are checked before anything
runs.

Legend: N the loop's matmul size; B, S the batch's sequences and tokens.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dropless.config.loader import ConfigError, load_config
from dropless.perf import measure
from dropless.train import checkpoint as ckpt_lib
from dropless.train import optimizer as opt_lib
from dropless.train import step as step_lib

PHASES = ("host", "snapshot", "device_get", "pinned", "orbax_pageable", "orbax_pinned")
MODES = ("none", "put", "fetch")
GB = 1e9
GiB = 2**30
HOST_PROBE_MAX = 4 * GiB
BATCH_SHAPE = (2, 4096)  # the proxy's per-device batch of token ids, put each "put" iteration


@dataclasses.dataclass(frozen=True)
class Settings:
    model_name: str
    matmul_n: int
    target_ms: float
    chunk: int
    baseline_rounds: int


FULL = Settings("deepseek3-proxy", matmul_n=8192, target_ms=75.0, chunk=4, baseline_rounds=3)
TINY = Settings("deepseek3-tiny", matmul_n=256, target_ms=5.0, chunk=2, baseline_rounds=1)


# --- the state ---------------------------------------------------------------------------------


def abstract_state(model_name: str, overrides: list[str]):
    """The train state's abstract tree, as ``dropless train`` builds it. Raises ConfigError."""
    cfg = load_config(None, [f"model_name={model_name}", *overrides], environ={}).config
    model, train = cfg.model(), cfg.train()
    tx = opt_lib.make_optimizer(train.optimizer, train.steps)
    _, init = step_lib.init_state_fn(model, tx, train.seed)
    return jax.eval_shape(init)


def _hash_u32(x):
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = (x ^ (x >> shift)) * jnp.uint32(mul)
    return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _uniform(seed_u32, std, *, shape, dtype):
    bits = _hash_u32(jax.lax.iota(jnp.uint32, int(np.prod(shape))) + seed_u32)
    unit = (bits >> 8).astype(jnp.float32) * 2.0**-24 - 0.5  # uniform on [-0.5, 0.5): std 1/sqrt(12)
    return (std * np.sqrt(12.0) * unit).reshape(shape).astype(dtype)


def uniform(seed: int, std: float, shape, dtype) -> jax.Array:
    """An array of ``shape`` on the first device: element j is hash(j + seed) as a uniform of mean 0
    and ``std``. One small program per shape and dtype: no random generator (XLA fuses one into
    each consumer, which compiles slowly) and no temporary."""
    return _uniform(np.uint32(seed % 2**32), np.float32(std), shape=tuple(shape), dtype=dtype)


def random_state(abstract):
    """``abstract`` on the first device: floats uniform with the init's std (0.02), leaf i
    ``uniform`` from seed i * 0x9E3779B9; integers zero. What Orbax's zstd makes of such values
    matters to the write only."""
    leaves, treedef = jax.tree.flatten(abstract)
    return jax.block_until_ready(treedef.unflatten([
        uniform(i * 0x9E3779B9, 0.02, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.zeros(x.shape, x.dtype) for i, x in enumerate(leaves)]))


# --- the compute loop --------------------------------------------------------------------------


def _chain(x_NN, w_NN, batch_BS, *, chain: int):
    """``chain`` matmuls x @ w @ w ..., unrolled (a traced trip count would make XLA:GPU copy the
    loop predicate to host each turn, a device-to-host fetch the ``none`` mode must not have);
    the mean of the result plus a term of the batch, so a put batch is an input."""
    y = x_NN
    for _ in range(chain):
        y = y @ w_NN
    return jnp.mean(y.astype(jnp.float32)) + 1e-9 * jnp.sum(batch_BS).astype(jnp.float32)


def _sample(mode, start, end, dispatch, iters) -> tuple:
    return mode, round(start, 6), round(end, 6), round(dispatch, 6), iters


class Loop:
    """The fixed compute loop run from the main thread beside a copy.

    Samples are (mode, start_s, end_s, dispatch_s, iterations), times from the
    phase's reference time: a ``none`` or ``put`` chunk is one sample (its
    dispatch, then a wait for its end), a ``fetch`` iteration is one.
    """
    def __init__(self, n: int, target_ms: float, chunk: int):
        self.x_NN = uniform(1, 1.0, (n, n), jnp.bfloat16)
        # Entries of variance 1/n: each product keeps the rows' norm in expectation.
        self.w_NN = uniform(2, 1 / np.sqrt(n), (n, n), jnp.bfloat16)
        self.batch_host_BS = np.arange(np.prod(BATCH_SHAPE), dtype=np.int32).reshape(BATCH_SHAPE)
        self.batch_BS = jax.device_put(self.batch_host_BS)
        self.chunk = chunk
        probe_chain = 4
        fn = jax.jit(functools.partial(_chain, chain=probe_chain))
        t = measure.time_fn(fn, self.x_NN, self.w_NN, self.batch_BS, warmup=1, iters=5, reps=1)
        self.matmul_ms = t["median_ms"] / probe_chain
        self.chain = int(min(256, max(1, round(target_ms / max(self.matmul_ms, 1e-6)))))
        self.fn = jax.jit(functools.partial(_chain, chain=self.chain))
        jax.block_until_ready(self.fn(self.x_NN, self.w_NN, self.batch_BS))  # compiled

    def _call(self, mode: str):
        batch = jax.device_put(self.batch_host_BS) if mode == "put" else self.batch_BS
        return self.fn(self.x_NN, self.w_NN, batch)

    def _chunk(self, mode: str, t_ref: float) -> list[tuple]:
        clock = time.perf_counter
        if mode == "fetch":
            out = []
            for _ in range(self.chunk):
                t0 = clock()
                y = self._call(mode)
                t1 = clock()
                float(y)
                out.append(_sample(mode, t0 - t_ref, clock() - t_ref, t1 - t0, 1))
            return out
        t0 = clock()
        for _ in range(self.chunk):
            y = self._call(mode)
        t1 = clock()
        jax.block_until_ready(y)
        return [_sample(mode, t0 - t_ref, clock() - t_ref, t1 - t0, self.chunk)]

    def run(self, busy, t_ref: float, min_rounds: int = 1) -> list[tuple]:
        """Rounds of one chunk per mode: at least ``min_rounds``, then while ``busy()``."""
        samples, rounds = [], 0
        while rounds < min_rounds or busy():
            for mode in MODES:
                samples += self._chunk(mode, t_ref)
            rounds += 1
        return samples


def summarize(samples, start: float, end: float, baseline: dict | None = None) -> dict:
    """Per mode, over the samples wholly inside [start, end]: iterations, mean / median / max
    ms per iteration, dispatch ms per iteration, and the mean against ``baseline``'s."""
    out = {}
    for mode in MODES:
        inside = [s for s in samples if s[0] == mode and s[1] >= start and s[2] <= end]
        iters = sum(s[4] for s in inside)
        if not iters:
            out[mode] = {"iters": 0}
            continue
        per = [(s[2] - s[1]) / s[4] * 1e3 for s in inside]
        mean = sum(s[2] - s[1] for s in inside) / iters * 1e3
        out[mode] = {"iters": iters, "mean_ms": mean, "median_ms": statistics.median(per),
                     "max_ms": max(per), "dispatch_ms": sum(s[3] for s in inside) / iters * 1e3}
        if baseline and baseline[mode].get("iters"):
            out[mode]["vs_baseline"] = mean / baseline[mode]["mean_ms"]
    return out


# --- the copies --------------------------------------------------------------------------------


def _timed(fn):
    """A function returning {"start", "end"} (perf_counter) around ``fn()``; its result dropped
    after the end mark (freeing 41 GiB of host memory is not part of the copy)."""
    def run():
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        del result
        return {"start": t0, "end": t1}
    return run


def beside_loop(marks_fn, loop: Loop) -> tuple[dict, list]:
    """Run ``marks_fn`` in a thread while the loop runs; (marks relative to the start, samples)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="copy") as pool:
        t_ref = time.perf_counter()
        future = pool.submit(marks_fn)
        samples = loop.run(lambda: not future.done(), t_ref)
        marks = {k: v - t_ref for k, v in future.result().items()}
    return marks, samples


def host_probe(nbytes: int) -> dict:
    """GB/s of numpy writing fresh pages (first touch) and copying between touched ones."""
    size = max(1, min(nbytes, HOST_PROBE_MAX))
    t0 = time.perf_counter()
    a = np.empty(size, np.uint8)
    a.fill(1)
    t1 = time.perf_counter()
    b = np.ones(size, np.uint8)
    t2 = time.perf_counter()
    np.copyto(b, a)
    t3 = time.perf_counter()
    return {"bytes": size, "first_touch_s": t1 - t0, "first_touch_gbps": size / GB / (t1 - t0),
            "copy_touched_s": t3 - t2, "copy_touched_gbps": size / GB / (t3 - t2)}


def orbax_manager(directory: str, pinned: bool):
    """A ``CheckpointManager`` with ``checkpoint.Checkpointer``'s options, items and handlers
    (async, saves of ``_save_args``'s two items), without its manifest sealing: the CRC pass
    would read the whole save back after the write this probe times."""
    options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None,
                                           enable_async_checkpointing=True, create=True)
    if pinned:
        return ocp.CheckpointManager(directory, options=options, item_names=ckpt_lib.ITEMS)
    return ocp.CheckpointManager(directory, options=options,
                                 item_handlers={n: ckpt_lib.pageable_standard_handler()
                                                for n in ckpt_lib.ITEMS})


def orbax_save(state, directory: str, pinned: bool, loop: Loop, baseline: dict) -> dict:
    """One Orbax save of ``state`` from a thread beside the loop (after a small warm-up save with
    a manager of the same kind): seconds until the save call returns and until the write ends."""
    def save(tree, where):
        manager = orbax_manager(where, pinned)
        try:
            t0 = time.perf_counter()
            manager.save(1, args=ckpt_lib._save_args(tree), force=True)  # noqa: SLF001 - Checkpointer's items
            t1 = time.perf_counter()
            manager.wait_until_finished()
            return {"start": t0, "call_end": t1, "end": time.perf_counter()}
        finally:
            manager.close()

    warm = os.path.join(directory, "warmup")
    save({k: jnp.zeros(8) for k in state}, warm)
    shutil.rmtree(warm)
    target = os.path.join(directory, "pinned" if pinned else "pageable")
    try:
        marks, samples = beside_loop(lambda: save(state, target), loop)
        written = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(target) for f in fs)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    nbytes = ckpt_lib.save_bytes(state)
    call, write = marks["call_end"] - marks["start"], marks["end"] - marks["call_end"]
    return {"call_s": call, "call_gbps": nbytes / GB / call, "write_s": write,
            "written_bytes": written, "write_gbps": written / GB / write,
            "total_s": marks["end"] - marks["start"],
            "loop": {"call": summarize(samples, marks["start"], marks["call_end"], baseline),
                     "write": summarize(samples, marks["call_end"], marks["end"], baseline)},
            "marks": marks, "samples": samples}


# --- checks before the run ---------------------------------------------------------------------


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def preflight(phases, nbytes: int, directory: str, on_cpu: bool) -> str | None:
    """One line if the disk under ``directory`` cannot hold an Orbax save of ``nbytes`` (before
    compression) or host memory cannot hold two host copies (three on CPU, where the device's
    state is host memory too), else None."""
    if any(p.startswith("orbax") for p in phases):
        free, path = ckpt_lib.free_bytes(directory)
        if free < nbytes:
            return (f"{free / GiB:.2f} GiB free on the filesystem of {path}, an Orbax save of this "
                    f"state writes up to {nbytes / GiB:.2f} GiB: free space there (a train run's "
                    "/tmp/runs?), pass --dir on a larger disk, or leave the orbax phases out of --phases")
    need = (3 if on_cpu else 2) * nbytes
    avail = _mem_available()
    if avail is not None and set(phases) & {"device_get", "pinned", "orbax_pageable", "orbax_pinned"} \
            and avail < need:
        return (f"{avail / GiB:.2f} GiB of host memory available, the copies need about "
                f"{need / GiB:.2f} GiB (the pinned pool stays allocated beside a pageable copy); "
                "make the state smaller with overrides (e.g. num_decoder_layers=2)")
    return None


# --- the run -----------------------------------------------------------------------------------


def _copy_row(phase: str, case: str, nbytes: int, marks: dict, samples=None, baseline=None) -> dict:
    seconds = marks["end"] - marks["start"]
    row = {"phase": phase, "case": case, "seconds": seconds, "gbps": nbytes / GB / seconds}
    if samples is not None:
        row["loop"] = {"copy": summarize(samples, marks["start"], marks["end"], baseline)}
        row["marks"], row["samples"] = marks, samples
    return row


def has_pinned_host() -> bool:
    return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())


def phase_rows(phase: str, state, loop: Loop, baseline: dict, work_dir: str,
               pinned_before: bool = False) -> list[dict]:
    """The rows of one phase (the module docstring says what each measures); ``pinned_before``:
    the ``pinned`` phase ran earlier in this process (XLA's pinned pool has grown)."""
    nbytes = ckpt_lib.save_bytes(state)
    if phase == "host":
        return [{"phase": phase, "case": "numpy, one thread", **host_probe(nbytes)}]
    if phase == "snapshot":
        copy = _timed(lambda: jax.block_until_ready(ckpt_lib.snapshot(state)))
        copy()  # compiles
        best = min((copy() for _ in range(2)), key=lambda m: m["end"] - m["start"])
        return [_copy_row(phase, "best of 2 (reads and writes each byte)", nbytes, best)]
    if phase == "device_get":
        jax.device_get(min(jax.tree.leaves(state), key=lambda x: x.nbytes))  # the transfer path set up
        get = _timed(lambda: jax.device_get(state))
        return [_copy_row(phase, "alone", nbytes, get()),
                _copy_row(phase, "beside the loop", nbytes, *beside_loop(get, loop), baseline)]
    if phase == "pinned":
        if not has_pinned_host():
            return [{"phase": phase, "skipped": f"{jax.devices()[0].platform} has no pinned_host memory"}]
        shardings = jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), state)

        def put():
            return jax.block_until_ready(jax.device_put(state, shardings))

        rows = [_copy_row(phase, "cold, beside the loop", nbytes, *beside_loop(_timed(put), loop), baseline)]
        t0 = time.perf_counter()
        pinned = put()
        rows.append(_copy_row(phase, "warm, alone", nbytes, {"start": t0, "end": time.perf_counter()}))
        rows.append(_copy_row("pinned_to_numpy", "the warm copy, device_get", nbytes,
                              _timed(lambda: jax.device_get(pinned))()))
        del pinned
        rows.append(_copy_row(phase, "warm, beside the loop", nbytes, *beside_loop(_timed(put), loop),
                              baseline))
        return rows
    pinned = phase == "orbax_pinned"
    # Orbax pins only where its handler's default says so: on GPU with a pinned_host memory.
    pins = pinned and jax.default_backend() == "gpu" and has_pinned_host()
    return [{"phase": phase, "case": "beside the loop", "pinned_copies": pins,
             "pool_warm": pins and pinned_before, **orbax_save(state, work_dir, pinned, loop, baseline)}]


def run(settings: Settings, overrides: list[str], abstract, phases: list[str], work_parent: str,
        out_dir) -> dict:
    """Fill ``abstract`` (the state of ``overrides``), build the loop, run ``phases``; the record
    (written after each phase)."""
    nbytes = ckpt_lib.save_bytes(abstract)
    record = measure.new_record("ckpt_transfer", {
        **dataclasses.asdict(settings), "overrides": overrides, "phases": phases,
        "state_bytes": nbytes, "state_gib": nbytes / GiB, "leaves": len(jax.tree.leaves(abstract)),
        "modes": list(MODES), "batch_shape": list(BATCH_SHAPE), "dir": work_parent,
        "pinned_host_memory": has_pinned_host(), "host_mem_available_bytes": _mem_available()})
    record["partial"] = True
    print(f"state: {nbytes / GiB:.2f} GiB in {record['config']['leaves']} arrays ({settings.model_name})",
          flush=True)
    t0 = time.perf_counter()
    state = random_state(abstract)
    loop = Loop(settings.matmul_n, settings.target_ms, settings.chunk)
    record["config"].update(build_s=time.perf_counter() - t0, chain=loop.chain, matmul_ms=loop.matmul_ms)
    print(f"built in {record['config']['build_s']:.1f} s; loop: {loop.chain} matmuls of "
          f"{settings.matmul_n}^2 bf16 ({loop.matmul_ms:.3f} ms each) per iteration", flush=True)
    baseline = summarize(loop.run(lambda: False, time.perf_counter(), settings.baseline_rounds),
                         -np.inf, np.inf)
    record["baseline"] = {"start": baseline}
    os.makedirs(work_parent, exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix="dropless-ckpt-transfer-", dir=work_parent)
    try:
        for phase in phases:
            t0 = time.perf_counter()
            pinned_before = "pinned" in phases[:phases.index(phase)]
            rows = phase_rows(phase, state, loop, baseline, work_dir, pinned_before)
            for row in rows:
                print(f"[{time.perf_counter() - t0:6.1f} s] {_line(row)}", flush=True)
            record["rows"] += rows
            record["path"] = str(measure.write_record(record, out_dir))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    record["baseline"]["end"] = summarize(
        loop.run(lambda: False, time.perf_counter(), settings.baseline_rounds), -np.inf, np.inf)
    record["partial"] = False
    record["path"] = str(measure.write_record(record, out_dir))
    return record


# --- the table ---------------------------------------------------------------------------------


def _mode_cells(summary: dict) -> list[str]:
    cells = []
    for mode in MODES:
        s = summary.get(mode, {})
        if not s.get("iters"):
            cells.append("-")
            continue
        x = f" ({s['vs_baseline']:.2f}x)" if "vs_baseline" in s else ""
        cells.append(f"{s['mean_ms']:.1f}{x} d{s['dispatch_ms']:.1f} n{s['iters']}")
    return cells


def table_rows(record: dict) -> list[list[str]]:
    """[phase, case, seconds, GB/s, loop none, put, fetch] per line of the table."""
    out = []
    for which, summary in record.get("baseline", {}).items():
        out.append([f"baseline ({which})", "loop alone", "", "", *_mode_cells(summary)])
    for row in record["rows"]:
        if "skipped" in row:
            out.append([row["phase"], f"skipped: {row['skipped']}", "", "", "-", "-", "-"])
        elif row["phase"] == "host":
            out.append(["host", "first touch", f"{row['first_touch_s']:.2f}",
                        f"{row['first_touch_gbps']:.2f}", "", "", ""])
            out.append(["host", "copy, touched", f"{row['copy_touched_s']:.2f}",
                        f"{row['copy_touched_gbps']:.2f}", "", "", ""])
        elif "call_s" in row:
            pool = "" if row["phase"] == "orbax_pageable" else (
                " (pool warm)" if row["pool_warm"] else " (pool cold)" if row["pinned_copies"]
                else " (pageable here)")
            out.append([row["phase"], "save call" + pool, f"{row['call_s']:.2f}", f"{row['call_gbps']:.2f}",
                        *_mode_cells(row["loop"]["call"])])
            out.append([row["phase"], "write (GB/s on disk)", f"{row['write_s']:.2f}",
                        f"{row['write_gbps']:.2f}", *_mode_cells(row["loop"]["write"])])
        else:
            loop = _mode_cells(row["loop"]["copy"]) if "loop" in row else ["", "", ""]
            out.append([row["phase"], row["case"], f"{row['seconds']:.2f}", f"{row['gbps']:.2f}", *loop])
    return out


def _line(row: dict) -> str:
    return "\n".join(" | ".join(r) for r in table_rows({"rows": [row]}))


def print_table(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = record["config"]
    table = Table(title=f"Copies of the {c['model_name']} train state ({c['state_gib']:.2f} GiB) "
                        f"on {record['device']['gpu']}; loop ms/iteration (x baseline) "
                        f"d dispatch ms, n iterations")
    for col in ("phase", "case", "s", "GB/s", "loop none", "loop put", "loop fetch"):
        table.add_column(col, justify="left" if col in ("phase", "case") else "right")
    for cells in table_rows(record):
        table.add_row(*cells)
    (Console() if sys.stdout.isatty() else Console(width=170)).print(table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config key=value overrides of the model")
    p.add_argument("--tiny", action="store_true", help="deepseek3-tiny and a small loop (CPU smoke run)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the Orbax saves go (a fresh directory in it, deleted after)")
    p.add_argument("--matmul-n", type=int, default=None, help="the loop's matmul size")
    p.add_argument("--target-ms", type=float, default=None, help="the loop's time per iteration")
    p.add_argument("--chunk", type=int, default=None, help="loop iterations per sample of one mode")
    p.add_argument("--out", type=Path, default=measure.DEFAULT_RESULTS_DIR)
    a = p.parse_args(argv)
    phases = [x for x in a.phases.split(",") if x]
    if unknown := sorted(set(phases) - set(PHASES)):
        p.error(f"unknown phases {unknown}; choose from {list(PHASES)}")
    base = TINY if a.tiny else FULL
    given = {"matmul_n": a.matmul_n, "target_ms": a.target_ms, "chunk": a.chunk}
    settings = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    if settings.matmul_n < 1 or settings.target_ms <= 0 or settings.chunk < 1:
        p.error("--matmul-n and --chunk must be >= 1, --target-ms > 0")
    phases = [x for x in PHASES if x in phases]
    try:
        abstract = abstract_state(settings.model_name, a.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    on_cpu = jax.devices()[0].platform == "cpu"
    if problem := preflight(phases, ckpt_lib.save_bytes(abstract), a.dir, on_cpu):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    record = run(settings, a.overrides, abstract, phases, a.dir, a.out)
    print_table(record)
    print(f"wrote {record['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
