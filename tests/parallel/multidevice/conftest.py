"""Eight CPU devices for the expert-parallel tests (set before JAX starts).

Run directly with ``DROPLESS_CPU_DEVICES=8 pytest tests/parallel/multidevice``
or through ``tests/parallel/test_multidevice.py``. XLA:CPU compiles at
optimisation level 0 here (compile time dominates these small programs).
"""

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

NUM_DEVICES = int(os.environ.get("DROPLESS_CPU_DEVICES", "8"))
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)

AXES = ("data", "fsdp", "expert", "tensor")


def make_mesh(data=1, fsdp=1, expert=1, tensor=1) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over the first data*fsdp*expert*tensor devices."""
    shape = (data, fsdp, expert, tensor)
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), AXES)


def rank0_bias(num_experts, ranks):
    """A balancing bias that makes every token pick rank 0's experts first."""
    import jax.numpy as jnp

    return jnp.zeros(num_experts).at[:num_experts // ranks].set(100.0)


def assert_same_values_and_grads(got, want, what):
    """(y, stats, (param grads, input grad)) of an expert-parallel block equal the
    single-device block's: outputs to 1e-5, gradients to 1e-4 relative."""
    y1, _, (gp1, gx1) = got
    y0, _, (gp0, gx0) = want
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5, err_msg=what)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-4, atol=1e-5, err_msg=what)
    flat0 = dict(jax.tree_util.tree_leaves_with_path(gp0))
    for path, g1 in jax.tree_util.tree_leaves_with_path(gp1):
        np.testing.assert_allclose(g1, flat0[path], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.fail(f"multidevice tests need 8 CPU devices, JAX has {jax.device_count()}: "
                    "the backend started before this conftest could set the count")
