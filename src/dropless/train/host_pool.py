"""Warm XLA's pinned host memory pool off the training loop's path, before the first save.

How an async save reaches host memory (orbax-checkpoint 0.12.4,
``_src/serialization/replica_slices.py: transfer_arrays_to_host``): before
``save`` returns, every shard Orbax writes (each distinct shard once, replica 0)
is copied with ``jax.device_put(shard, SingleDeviceSharding(device,
memory_kind="pinned_host"))`` and held until written. Pinned transfer is on
whenever the device has a ``pinned_host`` memory and the handler's
``enable_pinned_host_transfer`` is true, which it is by default on GPU
(``base_pytree_checkpoint_handler.py``: ``jax.default_backend() == "gpu"``;
``StandardCheckpointHandler`` exposes no switch). XLA allocates those
buffers from the device's pinned host allocator (``xla_gpu_host_bfc``: a BFC
pool that grows by pinning new regions, up to ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``,
64 by default), so the first save grows the pool to a whole save, pinning the
pages as it goes, while the loop waits; a BFC pool keeps its regions, and later
saves reuse them.

``HostPoolWarmup`` makes that growth happen in a background thread. What it
must not meet is a transfer between host and device: on the H200 (proxy,
41.1 GiB) pinning ran at about 0.8 GB/s, and while it ran a loop of GPU work
kept its speed (1.01x) as long as it moved no data to or from the host, but
slowed 18x when each iteration put a batch on the device and 58x when each
fetched a scalar (``benchmarks/ckpt_transfer.py``, ``ckpt_transfer-20261202-164033``):
the loop's small copies wait for the pinning. The training loop puts a batch
and fetches metrics every step, so a warm-up started after step 1 held steps
2-15 for 54.7 s (``train-20261202-051929``), and one started beside the first
compile slowed the compile by as much (its autotuning copies too). So the loop
starts it after the first timing window with the next steps' batches already
on the device and fetches nothing until it ends (``loop``, "quiet steps"). It
spares the first save's hold: 0.89 s instead of about 38 s. The thread allocates the
same buffers (same devices, shapes, dtypes and memory kind), holds them all
until ready, and drops them. Their source is a
host buffer of zeros, not the train state: the loop donates the state to every
step, so a copy from it in another thread would find it deleted or make the
donation wait. The copies go to the same memory of the same devices as
Orbax's and never touch device memory or the state, so training is unchanged.
One difference: an array replicated over several local devices is copied by
Orbax in slices, one per replica (``use_replica_parallel``, on unless
``JAX_PLATFORMS`` names gpu or cuda, where an axis divides among the replicas), where
the warm-up copies it whole on the first replica; the same bytes in all, in
more, smaller buffers. With one device per process the buffers are the same.
A save must not start while the warm-up runs (the two together would need twice
the pool): the loop calls ``wait`` first.
"""

import dataclasses
import math
import threading
import time

import jax
import numpy as np

PINNED_HOST = "pinned_host"
# How fast the warm-up pins host memory, for planning how many steps it spans:
# 41.12 GiB in 54.3 s on the H200 (train-20261202-051929), 0.82 GB/s beside a
# loop (ckpt_transfer-20261202-164033).
PIN_BYTES_PER_S = 0.8e9
# Backends where Orbax copies through pinned host memory (tests add "cpu").
BACKENDS = ("gpu",)
GiB = 2**30


def skip_reason(*, async_save: bool, memory_kind: str = PINNED_HOST) -> str | None:
    """Why a warm-up would not help this process (one phrase), or None if it would."""
    if not async_save:
        return "saves are synchronous (async_checkpointing=false)"
    backend = jax.default_backend()
    if backend not in BACKENDS:
        return f"the {backend} backend: Orbax copies to pinned host memory only on GPU"
    for device in jax.local_devices():
        if memory_kind not in {m.kind for m in device.addressable_memories()}:
            return f"{device.device_kind} has no {memory_kind} memory"
    return None


def _index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def host_copies(abstract, shardings) -> list[tuple[jax.Device, tuple[int, ...], np.dtype]]:
    """(device, shard shape, dtype) of every shard a save copies to this process's host.

    Each distinct shard once, on the first device holding it (replica 0, as
    ``jax.Array.addressable_shards`` numbers them). Key arrays (extended
    dtypes) are left out: Orbax saves their key data, a few bytes.
    """
    out = []
    for x, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            continue
        shape = tuple(sharding.shard_shape(x.shape))
        seen = set()
        for device, index in sharding.devices_indices_map(x.shape).items():
            key = _index_key(index)
            if key in seen:
                continue
            seen.add(key)
            if device.process_index == jax.process_index():
                out.append((device, shape, np.dtype(x.dtype)))
    return out


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class WarmResult:
    """seconds: the warm-up's wall time; nbytes: host bytes it allocated; error: one line, or None."""

    seconds: float
    nbytes: int
    error: str | None = None

    def line(self) -> str:
        if self.error is None:
            return (f"checkpoint: pinned host memory warmed in {self.seconds:.1f} s "
                    f"({self.nbytes / GiB:.2f} GiB); the first save reuses it")
        return (f"checkpoint: pinned host memory warm-up failed after {self.seconds:.1f} s "
                f"({self.error}); the first save allocates its own")


class HostPoolWarmup:
    """A background allocation of one save's host copies in ``memory_kind``; see the module docstring.

    Args:
      abstract: the train state's tree of arrays or ``ShapeDtypeStruct``s.
      shardings: its shardings (same tree structure).
      memory_kind: where Orbax copies to (``pinned_host`` on GPU).
    """

    def __init__(self, abstract, shardings, *, memory_kind: str = PINNED_HOST):
        self.copies = host_copies(abstract, shardings)
        self.nbytes = sum(_nbytes(shape, dtype) for _, shape, dtype in self.copies)
        self.memory_kind = memory_kind
        self.result: WarmResult | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, name="ckpt-host-warmup", daemon=True)

    def start(self) -> "HostPoolWarmup":
        self._thread.start()
        return self

    def _allocate(self) -> None:
        # One page-aligned buffer of zeros (untouched pages: no resident memory)
        # viewed as each shard; may_alias=False makes every put a new allocation.
        source = np.zeros(max((_nbytes(s, d) for _, s, d in self.copies), default=0), np.uint8)
        held = [
            jax.device_put(source[: _nbytes(shape, dtype)].view(dtype).reshape(shape),
                           jax.sharding.SingleDeviceSharding(device, memory_kind=self.memory_kind),
                           may_alias=False)
            for device, shape, dtype in self.copies
        ]
        jax.block_until_ready(held)  # all live at once, as during a save; then freed into the pool

    def _run(self) -> None:
        t0 = time.perf_counter()
        error = None
        try:
            self._allocate()
        except Exception as e:  # noqa: BLE001 - any failure is reported in one line; the save reports its own
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        self.result = WarmResult(time.perf_counter() - t0, self.nbytes, error)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def running(self) -> bool:
        """Started and not yet finished."""
        return self._thread.is_alive()

    def estimate_s(self) -> float:
        """The expected wall time (``PIN_BYTES_PER_S``)."""
        return self.nbytes / PIN_BYTES_PER_S

    def wait(self) -> float:
        """Block until the warm-up has finished; returns the seconds this call waited (0.0 if it had)."""
        if not self._thread.is_alive():
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - t0

    def report(self) -> WarmResult | None:
        """The result, the first time it is asked for after the warm-up finished; else None."""
        if self._reported or self._thread.is_alive() or self.result is None:
            return None
        self._reported = True
        return self.result
