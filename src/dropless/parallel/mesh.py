"""Device mesh with axes (data, fsdp, expert, tensor) and the shardings the trainer uses.

The mesh is ICI x DCN: ``ici_*`` axes split the devices of one slice (one
process on GPU: its local devices), ``dcn_*`` axes split the slices. On each
level one axis may be -1, meaning "whatever is left". The product of all axes
must equal the number of devices.

The batch is split over data x fsdp x expert, and the train state by the
rules of ``parallel.sharding`` (expert weights over ``expert`` and ``fsdp``,
other arrays ZeRO-3 style over ``fsdp`` x ``expert``). ``fsdp_spec`` is the
plain FSDP rule, kept for callers that shard a tree without paths.
"""

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dropless.config.sections import MeshConfig
from dropless.parallel import sharding
from dropless.parallel.sharding import BATCH_AXES

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def _fill(shape: list[int], total: int, level: str) -> list[int]:
    """Replace the one -1 of ``shape`` so its product is ``total``.

    Raises:
      ValueError: several -1, a non-positive size, or a product that cannot
        equal ``total``.
    """
    if shape.count(-1) > 1:
        raise ValueError(f"{level} mesh {dict(zip(MESH_AXES, shape))}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"{level} mesh {dict(zip(MESH_AXES, shape))}: sizes must be >= 1 or -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if total % known:
            raise ValueError(
                f"{level} mesh {dict(zip(MESH_AXES, shape))}: {total} devices are not divisible "
                f"by the fixed axes' product {known}"
            )
        shape = [total // known if s == -1 else s for s in shape]
    if math.prod(shape) != total:
        raise ValueError(
            f"{level} mesh {dict(zip(MESH_AXES, shape))} holds {math.prod(shape)} devices, "
            f"but there are {total}"
        )
    return shape


def mesh_shapes(cfg: MeshConfig, num_devices: int, num_slices: int = 1):
    """The (ici_shape, dcn_shape) of ``cfg`` for ``num_devices`` in ``num_slices`` slices.

    Raises:
      ValueError: the axes cannot be filled to exactly the device count.
    """
    if num_devices % num_slices:
        raise ValueError(f"{num_devices} devices do not split into {num_slices} equal slices")
    ici = [getattr(cfg, f"ici_{a}_parallelism") for a in MESH_AXES]
    dcn = [getattr(cfg, f"dcn_{a}_parallelism") for a in MESH_AXES]
    return _fill(ici, num_devices // num_slices, "ici"), _fill(dcn, num_slices, "dcn")


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A ``Mesh`` over ``devices`` (default: all) with axes ``MESH_AXES``.

    Each process is one DCN slice (the multi-host GPU convention).

    Raises:
      ValueError: the configured axes do not multiply to the device count.
    """
    devices = list(devices if devices is not None else jax.devices())
    num_slices = len({d.process_index for d in devices})
    ici, dcn = mesh_shapes(cfg, len(devices), num_slices)
    if num_slices == 1:
        shape = [i * d for i, d in zip(ici, dcn)]
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            # Topology-unaware fallback (CPU, odd device counts).
            grid = np.array(devices).reshape(shape)
    else:
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    return Mesh(grid, MESH_AXES)


def batch_shards(mesh: Mesh) -> int:
    """Number of ways the batch is split (data x fsdp x expert)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, leading_dims: int = 0) -> NamedSharding:
    """Sharding of a batch array whose batch axis follows ``leading_dims`` axes.

    ``leading_dims=1`` is the [A, B, S] layout of gradient accumulation.
    """
    return NamedSharding(mesh, P(*([None] * leading_dims), BATCH_AXES))


def held_indices(sharding, global_shape: tuple[int, ...], axis: int, devices=None) -> np.ndarray:
    """Sorted indices along ``axis`` of an array of ``global_shape`` that ``devices`` hold.

    ``devices`` defaults to this process's addressable devices: with the batch
    sharding and ``axis=1`` these are the sequences of each microbatch this
    process must load (not necessarily contiguous: on a hybrid mesh a process
    holds every other block when a DCN axis is minor in the batch axes).

    Raises:
      ValueError: ``devices`` hold no part of the array.
    """
    devices = sharding.addressable_devices if devices is None else set(devices)
    size = global_shape[axis]
    held = set()
    for device, index in sharding.devices_indices_map(tuple(global_shape)).items():
        if device in devices:
            held.update(range(*index[axis].indices(size)))
    if not held:
        raise ValueError(f"devices {sorted(d.id for d in devices)} hold no part of an array "
                         f"of shape {tuple(global_shape)} sharded as {sharding}")
    return np.array(sorted(held), np.int64)


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """Shard the largest axis divisible by ``fsdp`` over "fsdp"; replicate if none."""
    if fsdp == 1 or not shape:
        return P()
    candidates = [(size, i) for i, size in enumerate(shape) if size % fsdp == 0]
    if not candidates:
        return P()
    _, axis = max(candidates)
    return P(*([None] * axis), "fsdp")


def param_shardings(mesh: Mesh, tree):
    """NamedShardings for a pytree of arrays / ShapeDtypeStructs (``parallel.sharding`` rules)."""
    return sharding.state_shardings(mesh, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding (scalars, counters)."""
    return NamedSharding(mesh, P())
