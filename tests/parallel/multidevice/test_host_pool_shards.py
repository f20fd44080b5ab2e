"""``host_pool.host_copies`` on 8 CPU devices: the shards a save copies to host.

The reference is what Orbax copies (``replica_slices``): each addressable
shard of the real array whose ``replica_id`` is 0.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dropless.train import host_pool

SPECS = [P(), P("a"), P("a", "b"), P(("a", "b")), P(None, "c"), P("c", ("a", "b"))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_one_copy_per_distinct_shard_on_its_replica_0(spec):
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    sharding = NamedSharding(mesh, spec)
    x = jax.device_put(np.arange(8 * 12, dtype=np.float32).reshape(8, 12), sharding)
    want = sorted((s.device.id, s.data.shape, s.data.dtype) for s in x.addressable_shards if s.replica_id == 0)
    got = host_pool.host_copies({"x": jax.ShapeDtypeStruct(x.shape, x.dtype)}, {"x": sharding})
    assert sorted((d.id, shape, dtype) for d, shape, dtype in got) == want
