"""Sharding rules by path and shape, logical activation specs, and the multi-process environment."""

import pytest
from jax.sharding import PartitionSpec as P

from dropless.parallel import distributed
from dropless.parallel import sharding as sh

MESH = {"data": 2, "fsdp": 2, "expert": 4, "tensor": 1}


@pytest.mark.parametrize("names,shape,spec", [
    # Stacked MoE expert weights [L, E, D, 2F]: E over expert, the larger of D, 2F over fsdp.
    (("params", "moe_layers", "layers", "moe", "wi"), (3, 16, 8, 32), P(None, "expert", None, "fsdp")),
    (("params", "moe_layers", "layers", "moe", "wo"), (3, 16, 32, 8), P(None, "expert", "fsdp", None)),
    # Optimizer moments mirror the parameter tree.
    (("opt_state", "0", "mu", "moe_layers", "layers", "moe", "wi_0"), (3, 16, 8, 6),
     P(None, "expert", "fsdp", None)),
    # An unstacked (MTP) expert weight [E, D, F].
    (("params", "mtp", "0", "layer", "moe", "wo"), (16, 6, 8), P("expert", None, "fsdp")),
    # No dim divisible by fsdp: expert only.
    (("params", "moe", "wo"), (8, 3, 5), P("expert", None, None)),
    # Dense MLP weights named wi_0 end in .../kernel: ZeRO-3 over fsdp x expert, never L.
    (("params", "moe_layers", "layers", "moe", "shared_experts", "wi_0", "kernel"), (16, 8, 32),
     P(None, None, ("fsdp", "expert"))),
    (("params", "embed", "embedding"), (256, 64), P(("fsdp", "expert"), None)),
    # Only fsdp divides: fsdp alone; nothing divides: replicated.
    (("params", "head", "kernel"), (6, 10), P(None, "fsdp")),
    (("params", "final_norm", "scale"), (7,), P()),
    (("router_bias", "moe_layers", "layers", "moe", "router_bias"), (3, 16), P()),
    (("step",), (), P()),
])
def test_array_spec(names, shape, spec):
    assert sh.array_spec(names, shape, MESH) == spec


def test_one_device_replicates_everything():
    one = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert sh.array_spec(("params", "embed", "embedding"), (256, 64), one) == P()
    assert sh.array_spec(("params", "moe", "wi"), (8, 16, 32), one) == P("expert", None, None)


def test_logical_spec():
    assert sh.logical_spec(("batch", "seq", "embed")) == P(("data", "fsdp", "expert"), None, None)
    assert sh.logical_spec(("exp", None, "mlp")) == P("expert", None, None)
    with pytest.raises(KeyError, match="no sharding rule for logical axis 'length'"):
        sh.logical_spec(("batch", "length"))


def test_process_spec_from_env():
    assert distributed.spec_from_env({}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}
    assert distributed.spec_from_env(env) == ("10.0.0.1:1234", 4, 3)
    with pytest.raises(ValueError, match=r"missing"):
        distributed.spec_from_env({"JAX_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(ValueError, match="must be in"):
        distributed.spec_from_env({**env, "JAX_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="integers"):
        distributed.spec_from_env({**env, "JAX_NUM_PROCESSES": "four"})
    with pytest.raises(ValueError, match="host:port"):
        distributed.spec_from_env({**env, "JAX_COORDINATOR_ADDRESS": "localhost"})
