"""Orbax checkpoints with integrity manifests: save, resume, load parameters.

Layout: ``<run_dir>/checkpoints/<step>/`` with three Orbax items:

    model   {"params", "router_bias"}          what ``load_parameters_path`` loads
    opt     {"opt_state", "step", "skipped_steps"}
    dropless_manifest.json                     size and CRC32 of every file

Step N holds the state after N train steps. Orbax writes into a temporary
directory and renames it when complete, so a process killed mid-save leaves
no half checkpoint under a step name. Once the save is finalised (``poll``,
called every train step, sees Orbax idle) a background thread writes the
manifest; a step directory without one is treated as incomplete and skipped
on resume. A step
whose files disagree with its manifest (truncated, overwritten, missing) is
corrupt: ``CheckpointError`` says which and how to fall back, and nothing is
loaded. Checking reads every byte once, at restore time only.

Several processes (``jax.distributed``) share one run directory on a shared
filesystem; each holds only its shards of each array, and Orbax writes and
reads those. The manifest records files, not arrays, so no array needs to be
addressable by one process. Sealing is split: process 0 lists the finalised
step's files and publishes the list through the ``jax.distributed`` key-value
store, each process CRCs its share (every ``process_count``-th file) and
publishes the result, and process 0 writes the manifest; the others wait for
it before deciding anything that depends on a manifest. At restore each
process checks its share again and all of them raise the same
``CheckpointError`` if any share is bad.

Disk space. ``plan_disk`` checks, before a run trains, that the filesystem
holding the checkpoints has room for the saves the run makes: Orbax writes a
new save before deleting the oldest, so up to ``max_to_keep + 1`` are on disk
at once. A save that fails anyway (disk full, I/O error; raised by Orbax at the
save, or by its background write at the next ``poll``, save or ``close``) ends
the run with ``CheckpointSaveError``: one line naming the step, the cause and
the intact checkpoints to resume from. Finished checkpoints are never touched;
the failed save's partial ``<step>.orbax-checkpoint-tmp`` directory is removed
(one process only: with several it is left, and the next resume removes it).

Device snapshots (``device_snapshot``). Orbax's save copies the state to host
memory before it returns, and the loop waits for that copy (the proxy's first
save: about 38 s with pinned copies, 32 s with pageable ones). With a snapshot,
``save`` copies the state on the device instead (new buffers: the train step
donates the state it is given, so the copy must share none of them), waits
for that copy, and hands it to Orbax's save in a background thread; the loop
goes on while Orbax copies the snapshot to host memory and writes it. The
checkpointer drops its reference to the snapshot when that save call returns;
Orbax 0.12.4 keeps its own until its write ends (seen on CPU), so the copy's
device memory is in use from the save to the end of its write, beside the
steps. While the save call runs, only that
thread touches the ``CheckpointManager``: ``poll`` leaves it alone, and
``save``, ``wait`` and ``close`` first wait for it and raise its error as
``CheckpointSaveError``, as they do for a failed write.
"""

import concurrent.futures
import dataclasses
import errno
import glob
import itertools
import json
import os
import re
import shutil
import threading
import time
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

MANIFEST = "dropless_manifest.json"
ITEMS = ("model", "opt")
_MAX_ERROR_BYTES = 2048  # of a CheckpointError message shared between processes
_SEAL_TIMEOUT_MS = 3_600_000  # waiting for other processes' CRCs of a large checkpoint
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax writes <step><TMP_SUFFIX>[-...] and renames it to <step>
GiB = 2**30


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


class CheckpointSaveError(RuntimeError):
    """A save failed; ``step`` is the save's step, ``intact`` the complete checkpoints left."""

    def __init__(self, message: str, step: int, intact: list[int]):
        super().__init__(message)
        self.step = step
        self.intact = intact


class SaveTiming(NamedTuple):
    """How long one ``Checkpointer.save`` held the training loop.

    wait_s: waiting for the previous save to be written and sealed (0 when the
      period is long enough for the background writes).
    blocked_s: the whole call: ``wait_s`` plus the handoff to the background
      writer (Orbax copies the arrays to host memory before returning; with a
      device snapshot, the copy on the device and the handoff to the thread
      that calls Orbax).
    """

    step: int
    wait_s: float
    blocked_s: float


def _copy_on_device(tree):
    """A copy of every array of ``tree`` in new device buffers with the same shardings (``copy``
    is its own primitive, so no output is an input passed through and nothing aliases)."""
    return jax.tree.map(jnp.copy, tree)


snapshot = jax.jit(_copy_on_device)


def state_bytes_per_device(tree) -> int:
    """The most bytes of ``tree``'s arrays that any one of this process's devices holds."""
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names if n != MANIFEST]
    return sorted(out)


def _sizes_and_crcs(step_dir: str, names: list[str]) -> dict[str, list[int]]:
    return {n: [os.path.getsize(os.path.join(step_dir, n)), _crc32(os.path.join(step_dir, n))]
            for n in names}


def _write_manifest_of(step_dir: str, files: dict[str, list[int]]) -> None:
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": files}, f)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def write_manifest(step_dir: str) -> None:
    """Record size and CRC32 of every file under ``step_dir`` (atomically)."""
    _write_manifest_of(step_dir, _sizes_and_crcs(step_dir, _files(step_dir)))


def verify_manifest(step_dir: str, share: tuple[int, int] = (0, 1)) -> None:
    """Check the files of ``step_dir`` against its manifest.

    Args:
      share: (i, n): check only the files i, i+n, i+2n, ... of the manifest
        in name order (one process's share); the default checks all.

    Raises:
      CheckpointError: no manifest, or a file missing, truncated or changed.
    """
    path = os.path.join(step_dir, MANIFEST)
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {step_dir} is incomplete (no {MANIFEST})") from None
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {step_dir}: unreadable {MANIFEST} ({e})") from None
    hint = f"; delete {step_dir} to resume from the previous checkpoint"
    index, count = share
    for name in sorted(files)[index::count]:
        size, crc = files[name]
        full = os.path.join(step_dir, name)
        if not os.path.exists(full):
            raise CheckpointError(f"checkpoint {step_dir} is corrupt: {name} is missing{hint}")
        actual = os.path.getsize(full)
        if actual != size:
            raise CheckpointError(
                f"checkpoint {step_dir} is corrupt: {name} has {actual} bytes, expected {size} "
                f"(truncated?){hint}"
            )
        if _crc32(full) != crc:
            raise CheckpointError(f"checkpoint {step_dir} is corrupt: {name} fails its CRC32{hint}")


def _sync(name: str) -> None:
    """A barrier of all processes (nothing with one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def verify_everywhere(step_dir: str) -> None:
    """``verify_manifest`` split over all processes; each raises if any share is bad.

    Call it from every process (it is a collective when there are several).

    Raises:
      CheckpointError: as ``verify_manifest``, the same in every process.
    """
    if jax.process_count() == 1:
        verify_manifest(step_dir)
        return
    try:
        verify_manifest(step_dir, (jax.process_index(), jax.process_count()))
        message = b""
    except CheckpointError as e:
        message = str(e).encode()[:_MAX_ERROR_BYTES]
    mine = np.zeros(_MAX_ERROR_BYTES, np.uint8)
    mine[: len(message)] = np.frombuffer(message, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    for process, row in enumerate(everyone):
        if row.any():
            text = row.tobytes().rstrip(b"\0").decode(errors="replace")
            raise CheckpointError(f"{text} (checked by process {process})")


# --- disk space ---------------------------------------------------------------------------------


def pageable_standard_handler() -> ocp.StandardCheckpointHandler:
    """Orbax's ``StandardCheckpointHandler`` with its copies to host in pageable memory.

    Orbax 0.12.4 copies each saved array to ``pinned_host`` memory on GPU
    (``BasePyTreeCheckpointHandler``: ``enable_pinned_host_transfer`` defaults to
    ``jax.default_backend() == "gpu"``), and ``StandardCheckpointHandler`` passes no
    such switch to the ``PyTreeCheckpointHandler`` it wraps. This is the standard
    handler (same type, so ``StandardSave`` / ``StandardRestore`` still reach it;
    same files) with that inner handler built again with the switch off and the
    standard handler's other defaults.
    """
    handler = ocp.StandardCheckpointHandler()
    handler._impl = ocp.PyTreeCheckpointHandler(  # noqa: SLF001 - no public switch
        save_concurrent_gb=96, restore_concurrent_gb=96, use_ocdbt=True,
        enable_pinned_host_transfer=False)
    return handler


def save_bytes(abstract_state) -> int:
    """Bytes of every array of the train state (all devices together): one save before compression.

    Orbax compresses with zstd; on random-normal bf16 weights and float32 Adam
    moments it writes about 78% and 92% of these bytes, so this is an upper bound.
    """
    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(abstract_state))


def nearest_existing(directory: str) -> str:
    """The absolute path of ``directory`` or, if it does not exist, of its nearest existing parent."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(directory: str) -> tuple[int, str]:
    """(bytes free to this user, the path asked) on the filesystem of ``directory`` or its nearest existing parent."""
    path = nearest_existing(directory)
    return shutil.disk_usage(path).free, path


def step_dirs(directory: str) -> list[int]:
    """Steps with a directory under ``directory`` (complete or not), ascending; [] if none."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def complete_steps_in(directory: str, steps: list[int] | None = None) -> list[int]:
    """Steps under ``directory`` that have a manifest (finished and sealed), ascending.

    ``steps``: the ``step_dirs`` of ``directory`` if already listed (not listed again).
    """
    return [s for s in (step_dirs(directory) if steps is None else steps)
            if os.path.exists(os.path.join(directory, str(s), MANIFEST))]


def measured_bytes(step_dir: str) -> int | None:
    """Bytes on disk of a sealed checkpoint (the sizes its manifest records), or None."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            return sum(size for size, _ in json.load(f)["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_steps(start: int, steps: int, period: int) -> list[int]:
    """Steps a run from ``start`` to ``steps`` saves: multiples of ``period``, and the last step."""
    out = list(range((start // period + 1) * period, steps + 1, period))
    if steps > start and (not out or out[-1] != steps):
        out.append(steps)
    return out


def _gib(n: int) -> str:
    """``n`` bytes for a person: GiB with two decimals, smaller sizes in MiB or bytes."""
    if n >= GiB // 10:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} bytes"


@dataclasses.dataclass(frozen=True)
class DiskPlan:
    """Whether a run's saves fit on the checkpoint filesystem (``plan_disk``).

    free: bytes free now; path: where that was measured (the checkpoint
    directory or its nearest existing parent). per_save: bytes of one save, ``measured`` from
    the newest existing checkpoint's manifest, else the uncompressed state (an
    upper bound). existing: step directories already there (Orbax counts them
    toward ``keep``). saves: the steps this run will save at.
    """

    path: str
    free: int
    per_save: int
    measured: bool
    existing: int
    keep: int  # 0: all
    saves: tuple[int, ...]

    @property
    def at_once(self) -> int:
        """New saves on disk at the peak: ``keep`` plus the one being written, less those already there."""
        total = self.existing + len(self.saves)
        peak = total if self.keep == 0 else min(self.keep + 1, total)
        return max(peak - self.existing, 1) if self.saves else 0

    @property
    def fits(self) -> int:
        return self.free // max(self.per_save, 1)

    def _size(self) -> str:
        return (f"{_gib(self.per_save)} (measured on the newest checkpoint)" if self.measured
                else f"up to {_gib(self.per_save)} (parameters and optimizer state, before compression)")

    def _where(self) -> str:
        return f"{_gib(self.free)} free on the filesystem of {self.path}"

    def error(self) -> str | None:
        """One line if not even the first save fits, else None."""
        if not self.saves or self.fits >= 1:
            return None
        return (f"checkpoint: {self._where()} cannot hold one save of {self._size()}; free space there, "
                "point base_output_directory at a larger disk, or set enable_checkpointing=false")

    def warning(self) -> str | None:
        """One line if the first save fits but not all that are on disk at once, else None."""
        if not self.saves or self.fits < 1 or self.fits >= self.at_once:
            return None
        kept = ("max_num_checkpoints_to_keep=0 (all kept)" if self.keep == 0
                else f"max_num_checkpoints_to_keep={self.keep} kept + 1 being written")
        there = f", {self.existing} already there" if self.existing else ""
        fails = "will fail" if self.measured else "will fail unless compression saves enough"
        return (f"checkpoint: {self._where()} holds {self.fits} save(s) of {self._size()} but this run "
                f"needs room for {self.at_once} more ({kept}{there}): the save at step "
                f"{self.saves[self.fits]} {fails}; lower max_num_checkpoints_to_keep, point "
                "base_output_directory at a larger disk, or raise checkpoint_period (fewer saves)")


def plan_disk(directory: str, *, uncompressed_bytes: int, keep: int, period: int, start: int,
              steps: int, fresh: bool = False) -> DiskPlan:
    """The disk plan of a run that saves into ``directory`` from step ``start`` to ``steps``.

    Call it after incomplete checkpoints of a resume are removed. ``fresh``: a
    new run directory (nothing of ``directory`` is counted, only its free space).
    """
    existing = [] if fresh else step_dirs(directory)
    complete = complete_steps_in(directory, existing)
    measured = measured_bytes(os.path.join(directory, str(complete[-1]))) if complete else None
    free, path = free_bytes(directory)
    return DiskPlan(path=path, free=free,
                    per_save=measured or uncompressed_bytes, measured=measured is not None,
                    existing=len(existing), keep=keep, saves=tuple(save_steps(start, steps, period)))


def _root_cause(e: BaseException) -> tuple[str, int | None]:
    """(one-line cause, errno or None) of a failed save: the OSError or tensorstore error under ``e``."""
    chain, x = [], e
    while x is not None and x not in chain:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        if isinstance(x, OSError) and x.errno:
            return f"{os.strerror(x.errno)} (errno {x.errno})", x.errno
    for x in chain:  # tensorstore: "... No space left on device [source locations=...] [os_error_code='28']"
        if m := re.search(r"os_error_code='?(\d+)", str(x)):
            number = int(m[1])
            return f"{os.strerror(number)} (errno {number})", number
    text = re.sub(r"\s*\[source locations=.*?\]", "", str(chain[-1]))
    text = " ".join(text.split())[:300]
    return f"{type(chain[-1]).__name__}: {text}", None


def _save_args(state: dict) -> ocp.args.Composite:
    return ocp.args.Composite(
        model=ocp.args.StandardSave({"params": state["params"], "router_bias": state["router_bias"]}),
        opt=ocp.args.StandardSave({k: state[k] for k in ("opt_state", "step", "skipped_steps")}),
    )


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _restore_error(step_dir, e):
    return CheckpointError(
        f"checkpoint {step_dir} could not be restored: {type(e).__name__}: {str(e)[:500]}"
    )


class Checkpointer:
    """Periodic async saves of the train state and resume from the latest complete one.

    Args:
      directory: ``<run_dir>/checkpoints``.
      period: save when ``step % period == 0`` (and on ``force``).
      async_save: write in the background (the state is copied to host first).
      max_to_keep: keep the newest this many (0: all).
      per_save_bytes: the size of one save, for the disk pre-flight and the message of a
        failed one (0: unknown).
      pinned_host_transfer: Orbax's copies to host in pinned memory (its GPU default), else
        pageable (``pageable_standard_handler``).
      device_snapshot: save a copy of the state made on the device, from a background
        thread (module docstring); needs ``async_save``.

    A failed save raises ``CheckpointSaveError`` (from ``save``, ``poll``,
    ``wait`` or ``close``, whichever first sees it); the checkpointer is then
    closed and ``close`` does nothing more.
    """

    _instances = itertools.count()  # the same sequence in every process: key-value store names

    def __init__(self, directory: str, *, period: int, async_save: bool = True, max_to_keep: int = 0,
                 per_save_bytes: int = 0, pinned_host_transfer: bool = True,
                 device_snapshot: bool = False):
        if period < 1:
            raise ValueError(f"checkpoint_period={period} must be >= 1")
        if device_snapshot and not async_save:
            raise ValueError("device_snapshot saves in the background; it needs async_save")
        self.directory = os.path.abspath(directory)
        self._async = async_save
        self._period = period
        self._lock = threading.Lock()
        self._unsealed: list[tuple[int, int]] = []  # (step, save number) still without a manifest
        self._saves = 0
        self._kv_prefix = f"dropless_checkpoint/{next(Checkpointer._instances)}"
        self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-manifest")
        self._sealing = None
        self._writing: int | None = None  # the step Orbax may still be writing
        self.device_snapshot = device_snapshot
        self._handoff = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot")
                         if device_snapshot else None)
        self._handing: tuple[int, concurrent.futures.Future] | None = None  # (step, Orbax's save of its snapshot)
        self._handed: tuple[int, float] | None = None  # (step, seconds) of a handoff that ended, unreported
        self._failed = False
        self.per_save_bytes = per_save_bytes
        self.last_timing: SaveTiming | None = None  # of the latest save that saved
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=period,
            max_to_keep=max_to_keep or None,
            enable_async_checkpointing=async_save,
            create=True,
        )
        if pinned_host_transfer:  # Orbax's default handlers: pinned copies on GPU
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        else:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={name: pageable_standard_handler() for name in ITEMS})

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def due(self, step: int, *, force: bool = False) -> bool:
        """Whether ``save(step, force=force)`` saves: a multiple of the period, or forced."""
        return force or step % self._period == 0

    def _seal(self) -> None:
        """Write manifests of finalised saves (every process does its share)."""
        with self._lock:
            saves, self._unsealed = self._unsealed, []
        for step, number in saves:
            try:
                if jax.process_index() == 0 and not os.path.isdir(self.step_dir(step)):
                    with self._lock:  # not renamed into place yet: try again on the next poll
                        self._unsealed.append((step, number))
                elif jax.process_count() == 1:
                    write_manifest(self.step_dir(step))
                else:
                    self._seal_shared(step, f"{self._kv_prefix}/{number}")
            except Exception as e:
                e.dropless_step = step  # which save's manifest failed, for ``wait``
                raise

    def _seal_shared(self, step: int, key: str) -> None:
        """Process 0 lists the files, each process CRCs its share, process 0 writes the manifest."""
        client = ocp.multihost.get_jax_distributed_client()
        index, count = jax.process_index(), jax.process_count()
        step_dir = self.step_dir(step)
        if index == 0:
            names = _files(step_dir)
            client.key_value_set(f"{key}/files", json.dumps(names))
        else:  # one list for all: the others wait until the save is finalised
            names = json.loads(client.blocking_key_value_get(f"{key}/files", _SEAL_TIMEOUT_MS))
        files = _sizes_and_crcs(step_dir, names[index::count])
        if index != 0:
            client.key_value_set(f"{key}/crc/{index}", json.dumps(files))
            return
        for other in range(1, count):
            share = client.blocking_key_value_get(f"{key}/crc/{other}", _SEAL_TIMEOUT_MS)
            files.update(json.loads(share))
        _write_manifest_of(step_dir, files)
        client.key_value_delete(key)  # with everything under it

    def _save_snapshot(self, step: int, args: ocp.args.Composite) -> tuple[bool, float]:
        """Orbax's save of a snapshot, in the handoff thread: (saved, seconds it took)."""
        t0 = time.perf_counter()
        saved = self._manager.save(step, args=args, force=True)
        return saved, time.perf_counter() - t0

    def _end_handoff(self) -> None:
        """Wait for Orbax's save of the latest snapshot, if one was handed off; its write is then in flight.

        Raises:
          CheckpointSaveError: that save call failed.
        """
        if self._handing is None:
            return
        (step, future), self._handing = self._handing, None
        try:
            saved, seconds = future.result()
        except Exception as e:
            raise self._fail(step, e) from e
        self._handed = (step, seconds)
        self._writing = step if saved else None

    def take_handoff_seconds(self) -> tuple[int, float] | None:
        """(step, seconds) that Orbax's save of the latest device snapshot ran in the background
        thread (its copy to host memory and the handoff to its writer), once: at the first call
        after ``poll``, ``save`` or ``wait`` saw it end; else None."""
        handed, self._handed = self._handed, None
        return handed

    def poll(self) -> None:
        """Seal a finished save in the background; cheap, call it every step.

        Raises:
          CheckpointSaveError: the background write of the latest save, or Orbax's save of
            its device snapshot, failed.
        """
        if self._handing is not None:
            if not self._handing[1].done():
                return  # the manager belongs to the handoff thread until Orbax has the snapshot
            self._end_handoff()
        if self._writing is not None and not self._manager.is_saving_in_progress():
            step, self._writing = self._writing, None
            try:  # returns at once: the write is over; raises if it failed
                self._manager.wait_until_finished()
            except Exception as e:
                raise self._fail(step, e) from e
        if self._unsealed and not self._manager.is_saving_in_progress():
            if self._sealing is None or self._sealing.done():
                self._sealing = self._sealer.submit(self._seal)

    def save(self, step: int, state: dict, *, force: bool = False) -> bool:
        """Save ``state`` as step ``step`` if due (or forced). Returns whether it saved
        (with a device snapshot: handed it off; that save's errors come from the next
        ``poll``, ``save``, ``wait`` or ``close``)."""
        # Our own schedule: Orbax's would also save the first step of a run.
        if not self.due(step, force=force):
            return False
        if self._failed:
            raise RuntimeError("a checkpoint save failed earlier; this Checkpointer is closed")
        t0 = time.perf_counter()
        # One save in flight at a time; the previous one gets its manifest, and
        # every process sees it before the checks below (they must all agree).
        self.wait()
        waited = time.perf_counter() - t0
        if step in self._manager.all_steps():
            if os.path.exists(os.path.join(self.step_dir(step), MANIFEST)):
                return False  # e.g. the last step coinciding with a periodic save
            self.delete(step)  # an unsealed leftover of a killed run: write it again
        self._saves += 1
        with self._lock:
            self._unsealed.append((step, self._saves))
        if self.device_snapshot:
            try:  # waited for: the copy's device time is the loop's, not the next step's
                copy = jax.block_until_ready(snapshot(state))
            except Exception as e:
                raise self._fail(step, e) from e
            # Only the handoff thread and Orbax hold the copy from here.
            self._handing = (step, self._handoff.submit(self._save_snapshot, step, _save_args(copy)))
            del copy
            saved = True
        else:
            try:
                saved = self._manager.save(step, args=_save_args(state), force=True)
                if not self._async:
                    self._seal()
            except Exception as e:
                raise self._fail(step, e) from e
            self._writing = step if saved and self._async else None
        if saved:
            self.last_timing = SaveTiming(step, waited, time.perf_counter() - t0)
        return saved

    def wait(self) -> None:
        """Block until the save in flight is finalised and sealed (in every process).

        Raises:
          CheckpointSaveError: that save (its write or its manifest) failed.
        """
        if self._failed:
            return
        self._end_handoff()
        step = self._writing
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._fail(step, e) from e
        self._writing = None
        try:
            if self._sealing is not None:
                self._sealing.result()  # re-raises a failed manifest write
            self._seal()
        except Exception as e:
            raise self._fail(getattr(e, "dropless_step", step), e) from e
        _sync("dropless-checkpoint-sealed")  # process 0's manifests are on disk

    def close(self) -> None:
        """Finish the save in flight and close; raises ``CheckpointSaveError`` if it failed."""
        if self._failed:
            return
        self.wait()
        if self._handoff is not None:
            self._handoff.shutdown()
        self._sealer.shutdown()
        self._manager.close()

    def _fail(self, step: int | None, e: BaseException) -> CheckpointSaveError:
        """Close after save ``step`` failed with ``e``: remove its partial files; the error to raise."""
        self._failed = True
        free_then, path = free_bytes(self.directory)
        if self._handoff is not None:  # idle: a failure is seen only once its handoff ended
            self._handoff.shutdown()
        self._sealer.shutdown(wait=True)  # a manifest being written for an earlier step finishes
        try:
            self._manager.close()  # waits for Orbax's writer threads; their errors are ``e``'s
        except Exception:  # noqa: BLE001 - the error being reported is ``e``
            pass
        partial = []
        if step is not None and jax.process_count() == 1:
            partial = glob.glob(os.path.join(self.directory, f"{step}{TMP_SUFFIX}*"))
            for d in partial:
                shutil.rmtree(d, ignore_errors=True)
        free_now, _ = free_bytes(self.directory)
        intact = [s for s in complete_steps_in(self.directory) if s != step]
        cause, number = _root_cause(e)
        what = f"checkpoint save at step {step}" if step is not None else "checkpoint save"
        space = f"{_gib(free_then)} free on the filesystem of {path}"
        if self.per_save_bytes:
            space += f", a save writes up to {_gib(self.per_save_bytes)}"
        if partial:
            space += f"; its partial files were removed ({', '.join(partial)}; {_gib(free_now)} free now)"
        elif jax.process_count() > 1:
            space += f"; its partial files ({step}{TMP_SUFFIX}) are left, the next resume removes them"
        if intact:
            steps = "step" if len(intact) == 1 else "steps"
            resume = (f"intact checkpoints: {steps} {', '.join(map(str, intact))} in {self.directory}; "
                      f"the same command resumes from step {intact[-1]}")
        else:
            resume = f"no complete checkpoint in {self.directory} to resume from"
        fix = ""
        if number == errno.ENOSPC:
            fix = ("; to make room: free space, lower max_num_checkpoints_to_keep, raise checkpoint_period "
                   "or point base_output_directory at a larger disk")
        message = f"{what} failed: {cause}; {space}; {resume}{fix}"
        return CheckpointSaveError(message, -1 if step is None else step, intact)

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step`` (e.g. an incomplete one being superseded)."""
        self._manager.delete(step)

    def complete_steps(self) -> list[int]:
        """Finalised steps that have a manifest, ascending."""
        return complete_steps_in(self.directory, sorted(self._manager.all_steps()))

    def incomplete_steps(self) -> list[int]:
        complete = set(self.complete_steps())
        return [s for s in sorted(self._manager.all_steps()) if s not in complete]

    def prepare_resume(self) -> tuple[int | None, list[int]]:
        """(newest complete step or None, incomplete steps after it, now removed).

        Incomplete steps newer than the last complete one were killed before
        their manifests were written; the run redoes and saves them again.
        Orbax's partial ``<step>.orbax-checkpoint-tmp`` directories are removed too. Call
        it from every process: all list the directory before any removes.
        """
        complete = self.complete_steps()
        stale = [x for x in self.incomplete_steps() if not complete or x > complete[-1]]
        partial = glob.glob(os.path.join(self.directory, f"*{TMP_SUFFIX}*"))
        _sync("dropless-checkpoint-listed")
        for step in stale:
            self.delete(step)
        if jax.process_index() == 0:  # partial writes of a failed or killed save: never a checkpoint
            for d in partial:
                shutil.rmtree(d, ignore_errors=True)
        _sync("dropless-checkpoint-partial-removed")
        return (complete[-1] if complete else None), stale

    def restore(self, step: int, abstract_state: dict, shardings: dict) -> dict:
        """The full train state of ``step``, verified, placed with ``shardings``.

        Raises:
          CheckpointError: the step is corrupt, incomplete or does not match the model.
        """
        step_dir = self.step_dir(step)
        verify_everywhere(step_dir)
        target = _abstract(abstract_state, shardings)
        args = ocp.args.Composite(
            model=ocp.args.StandardRestore({k: target[k] for k in ("params", "router_bias")}),
            opt=ocp.args.StandardRestore({k: target[k] for k in ("opt_state", "step", "skipped_steps")}),
        )
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:  # tensorstore/orbax raise many types for bad data
            raise _restore_error(step_dir, e) from e
        return {**restored["model"], **restored["opt"]}


def load_parameters(path: str, abstract_model: dict, shardings: dict) -> dict:
    """``{"params", "router_bias"}`` from a checkpoint step directory (or its ``model`` item).

    Raises:
      CheckpointError: no such checkpoint, a corrupt one, or parameters that
        do not match the model's shapes.
    """
    path = os.path.abspath(path.rstrip("/"))
    item_dir = os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path
    step_dir = os.path.dirname(item_dir)
    if not os.path.isdir(item_dir):
        raise CheckpointError(f"load_parameters_path={path!r}: no such checkpoint directory")
    verify_everywhere(step_dir)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(item_dir, _abstract(abstract_model, shardings))
    except Exception as e:  # see Checkpointer.restore
        raise _restore_error(step_dir, e) from e


def initial_parameters(model_cfg, train_cfg, abstract_model: dict, shardings: dict) -> dict | None:
    """``{"params", "router_bias"}`` from ``load_parameters_path`` or ``hf_model_path``; None if neither.

    Raises:
      CheckpointError: as ``load_parameters``.
      dropless.hf.load.HFCheckpointError: the Hugging Face directory does not
        hold the model (a ``ConfigError``: one line, exit code 2 from the CLI).
    """
    if train_cfg.load_parameters_path:
        return load_parameters(train_cfg.load_parameters_path, abstract_model, shardings)
    if train_cfg.hf_model_path:
        from dropless.hf.load import load_hf

        return load_hf(train_cfg.hf_model_path, model_cfg, abstract_model, shardings)
    return None
