"""``checkpoint.snapshot`` on 8 CPU devices: every shard copied into a new buffer on
its own device, the array's sharding kept (Orbax saves the copy shard by shard)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dropless.train import checkpoint as ckpt_lib

SPECS = [P(), P("a"), P("a", "b"), P(("a", "b")), P(None, "c"), P("c", ("a", "b"))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_each_shard_is_copied_in_place(spec):
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    x = jax.device_put(np.arange(8 * 12, dtype=np.float32).reshape(8, 12), NamedSharding(mesh, spec))
    y = ckpt_lib.snapshot({"x": x})["x"]
    assert y.sharding.is_equivalent_to(x.sharding, x.ndim)
    before = {(s.device, s.index): s.data for s in x.addressable_shards}
    for shard in y.addressable_shards:
        old = before[(shard.device, shard.index)]
        assert shard.data.unsafe_buffer_pointer() != old.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(old))
    assert ckpt_lib.state_bytes_per_device({"x": x}) == max(
        sum(s.data.nbytes for s in x.addressable_shards if s.device == d) for d in mesh.devices.flat)
