"""Mesh shapes from ICI/DCN settings, their errors, the batch indices a process holds, and
the FSDP sharding rule."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from dropless.config.sections import MeshConfig
from dropless.parallel import mesh as mesh_lib


def test_fill_and_product():
    cfg = MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1, ici_expert_parallelism=2)
    ici, dcn = mesh_lib.mesh_shapes(cfg, 16)
    assert ici == [2, 4, 2, 1] and dcn == [1, 1, 1, 1]
    ici, dcn = mesh_lib.mesh_shapes(MeshConfig(), 16, num_slices=2)
    assert ici == [1, 8, 1, 1] and dcn == [2, 1, 1, 1]


@pytest.mark.parametrize("cfg,devices,match", [
    (MeshConfig(ici_data_parallelism=3), 8, "not divisible"),
    (MeshConfig(ici_fsdp_parallelism=4), 8, "holds 4 devices, but there are 8"),
    (MeshConfig(ici_data_parallelism=-1), 8, "at most one axis may be -1"),
    (MeshConfig(ici_tensor_parallelism=0), 8, "sizes must be >= 1 or -1"),
])
def test_errors(cfg, devices, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.mesh_shapes(cfg, devices)


def test_make_mesh_on_this_host():
    mesh = mesh_lib.make_mesh(MeshConfig())
    assert mesh.axis_names == mesh_lib.MESH_AXES
    assert mesh.size == jax.device_count() and mesh.shape["fsdp"] == jax.device_count()
    assert mesh_lib.batch_shards(mesh) == jax.device_count()
    with pytest.raises(ValueError, match="holds"):
        mesh_lib.make_mesh(MeshConfig(ici_fsdp_parallelism=jax.device_count() + 1))


def test_held_indices_of_this_process():
    mesh = mesh_lib.make_mesh(MeshConfig())
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    # One process holds every sequence; the leading accumulation axis is never split.
    assert mesh_lib.held_indices(sharding, (2, 4 * jax.device_count(), 8), 1).tolist() == list(
        range(4 * jax.device_count()))
    assert mesh_lib.held_indices(sharding, (2, 4 * jax.device_count(), 8), 0).tolist() == [0, 1]
    with pytest.raises(ValueError, match="hold no part of an array of shape"):
        mesh_lib.held_indices(sharding, (2, 4, 8), 1, devices=[])


def test_fsdp_rule():
    assert mesh_lib.fsdp_spec((6, 8, 3), 4) == P(None, "fsdp")
    assert mesh_lib.fsdp_spec((16, 8), 4) == P("fsdp")
    assert mesh_lib.fsdp_spec((3, 5), 4) == P()
    assert mesh_lib.fsdp_spec((), 4) == P()
    assert mesh_lib.fsdp_spec((16, 8), 1) == P()
