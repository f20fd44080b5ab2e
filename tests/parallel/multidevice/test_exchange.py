"""The padded exchange on 8 CPU devices against NumPy, and the ragged one's lowering.

Each rank sends random row counts to every other; the receive buffers must
hold exactly the rows that fit, in sender order (the ``ragged_all_to_all``
contract), and the gradient (the return trip) must reach exactly the rows
that went out. ``ragged_all_to_all`` cannot run on XLA:CPU, so the ragged
exchange is checked to lower to it with the same operands.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

from dropless.parallel import exchange

R, N, D = 8, 12, 3  # ranks, send-buffer rows, features


def _exchange_fn(mesh, capacity, impl):
    def per_rank(x_ND, counts_RR):
        counts_RR = counts_RR.reshape(R, R)
        trips = exchange.layouts(counts_RR, capacity, jax.lax.axis_index("expert"))
        move = functools.partial(exchange.exchange, axis_name="expert", impl=impl,
                                 chunk_rows=N)
        y_MD = move(x_ND, capacity, trips.out, trips.back)
        return y_MD, trips.dropped_rows[None]

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(P("expert"), P()),
                         out_specs=(P("expert"), P("expert")))


@pytest.mark.parametrize("capacity", [5, 40, 96])
def test_padded_matches_numpy(capacity, rng):
    mesh = make_mesh(expert=R)
    counts = rng.integers(0, 4, size=(R, R))
    counts[:, 2] = rng.integers(0, N // R + 1, size=R)  # crowd rank 2
    counts = np.minimum(counts, N // R).astype(np.int32)  # rows of each sender fit its buffer
    x = rng.standard_normal((R * N, D)).astype(np.float32)
    fn = jax.jit(_exchange_fn(mesh, capacity, "padded"))
    y, dropped = fn(jnp.asarray(x), jnp.asarray(counts.reshape(-1)))
    y = np.asarray(y).reshape(R, capacity, D)
    send = x.reshape(R, N, D)
    for q in range(R):
        rows = [send[s, counts[s, :q].sum():][:counts[s, q]] for s in range(R)]
        want = np.concatenate(rows)[:capacity]
        np.testing.assert_array_equal(y[q, :len(want)], want)
        assert not y[q, len(want):].any()
        assert dropped[q] == max(0, counts[:, q].sum() - capacity)
    # Gradient of sum(y * c): the return trip hands each sent row its cotangent.
    c = rng.standard_normal((R * capacity, D)).astype(np.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, jnp.asarray(counts.reshape(-1)))[0] * c)))(
        jnp.asarray(x))
    g = np.asarray(g).reshape(R, N, D)
    c = c.reshape(R, capacity, D)
    for s in range(R):
        expect = np.zeros((N, D), np.float32)
        for q in range(R):
            start, land = counts[s, :q].sum(), counts[:s, q].sum()
            fit = int(np.clip(capacity - land, 0, counts[s, q]))
            expect[start:start + fit] = c[q, land:land + fit]
        np.testing.assert_array_equal(g[s], expect)


def test_ragged_lowers_to_ragged_all_to_all():
    mesh = make_mesh(expert=R)
    fn = _exchange_fn(mesh, 16, "ragged")
    x = jax.ShapeDtypeStruct((R * N, D), jnp.float32)
    counts = jax.ShapeDtypeStruct((R * R,), jnp.int32)
    text = jax.jit(fn).lower(x, counts).as_text()
    assert text.count("ragged_all_to_all") >= 1
    grad_text = jax.jit(jax.grad(lambda x, c: jnp.sum(fn(x, c)[0] ** 2))).lower(x, counts).as_text()
    # Forward trip and its transpose, the return trip.
    assert grad_text.count("ragged_all_to_all") >= 2
    with pytest.raises(ValueError, match="not one of"):
        exchange.exchange(jnp.zeros((2, 1)), 2, None, None, axis_name="expert", impl="nccl",
                          chunk_rows=2)


def test_ragged_moe_block_lowers_on_a_data_x_expert_mesh():
    # Inside a larger mesh the tokens vary over data too: the ragged output buffer must as well.
    from flax import nnx

    from dropless.config.sections import MoEConfig
    from dropless.nn.moe import MoEBlock
    from dropless.parallel import ep as ep_lib

    mesh = make_mesh(data=2, expert=4)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=8, gmm_backend="xla")
    block = MoEBlock(cfg, emb_dim=8, rngs=nnx.Rngs(0),
                     ep=ep_lib.ExpertParallel(mesh, buffer_factor=2.0, exchange="ragged"))
    graphdef, state = nnx.split(block)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0] ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, jnp.ones((8, 4, 8))).as_text()
    # Tokens out, metadata out, results back; and the three opposite trips.
    assert text.count("ragged_all_to_all") == 6
