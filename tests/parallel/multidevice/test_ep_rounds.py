"""Extra exchange rounds (``ep_overflow_rounds``): overflow delivered, not dropped.

A load larger than the receive and expert buffers (factor 1.0, every token
routed to rank 0's experts) must, with enough rounds, give the single-device
block's outputs and gradients exactly as the exact-worst-case buffers do,
count no overflow and report the extra passes it ran; with too few rounds,
what is left over is counted by hand; a load that fits runs no extra pass.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_values_and_grads, make_mesh, rank0_bias
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dropless.config.sections import MoEConfig
from dropless.nn.moe import MoEBlock
from dropless.parallel import ep as ep_lib
from dropless.parallel import sharding

D = 8
T = 2  # tokens per rank: 8 x 2 tokens over data=2 x expert=4


def _block(cfg, ep=None):
    return MoEBlock(cfg, emb_dim=D, rngs=nnx.Rngs(0), ep=ep)


def _run(block, x, c, mesh=None, bias=None):
    graphdef, state = nnx.split(block)
    if bias is not None:
        state["router_bias"] = jax.tree.map(lambda b: jnp.zeros_like(b) + bias,
                                            state["router_bias"])
    if mesh is not None:
        state = jax.device_put(state, sharding.state_shardings(mesh, state))
        x = jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH_AXES)))

    (_, (y, stats)), grads = _value_and_grads(graphdef)(state, x, c)
    return y, stats, grads


@functools.cache
def _value_and_grads(graphdef):
    """Jitted (state, x, c) -> ((sum(y * c), (y, stats)), (dstate, dx)): one per block
    structure, so draws of new inputs and biases reuse its compiled programs."""
    def loss(state, x, c):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * c), (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("k", [1, 2])
def test_rounds_deliver_what_one_buffer_cannot(k, rng):
    mesh = make_mesh(data=2, expert=4)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=k, moe_mlp_dim=4, gmm_backend="xla",
                    routed_bias=True)
    x = jnp.asarray(rng.standard_normal((8, 2, D)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((8, 2, D)), jnp.float32)
    bias = rank0_bias(cfg.num_experts, 4)
    want = _run(_block(cfg), x, c, bias=bias)
    # Rank 0 of each data group is sent 4 ranks x T = 8 rows. k=1: buffer T*min(K,R) = 2
    # rows, so 4 row windows (3 extra rounds), each 2 copies in an expert buffer of T*K = 2.
    # k=2: buffer 4 rows, 2 row windows; each brings 8 copies for an expert buffer of 4,
    # 2 passes each: 1 extra round + 2 extra passes.
    rounds, extra = (3, 3) if k == 1 else (1, 3)
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=1.0, exchange="padded",
                               overflow_rounds=rounds)
    got = _run(_block(cfg, ep), x, c, mesh, bias=bias)
    assert_same_values_and_grads(got, want, f"k={k} rounds={rounds}")
    stats = got[1]
    assert int(stats.overflow_tokens) == 0
    assert float(stats.buffer_factor_needed) == 4.0
    assert int(stats.ep_extra_rounds) == extra
    np.testing.assert_array_equal(stats.tokens_per_expert, want[1].tokens_per_expert)


def test_too_few_rounds_count_what_is_left():
    # k=1, factor 1: rank 0's 4 x T = 8 rows per data group arrive in windows of T = 2;
    # one extra round delivers 4 of them, 4 per data group are left (8 in all).
    mesh = make_mesh(data=2, expert=4)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=1, moe_mlp_dim=4, gmm_backend="xla",
                    routed_bias=True)
    x = jax.random.normal(jax.random.key(1), (8, 2, D))
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=1.0, exchange="padded", overflow_rounds=1)
    _, stats, _ = _run(_block(cfg, ep), x, jnp.ones_like(x), mesh,
                       bias=rank0_bias(cfg.num_experts, 4))
    assert int(stats.overflow_tokens) == 2 * (4 * T - 2 * T)
    assert int(stats.ep_extra_rounds) == 1


def test_a_load_that_fits_runs_no_extra_pass(rng):
    mesh = make_mesh(expert=8)
    cfg = MoEConfig(num_experts=16, num_experts_per_tok=2, moe_mlp_dim=4, gmm_backend="xla")
    x = jnp.asarray(rng.standard_normal((8, 2, D)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((8, 2, D)), jnp.float32)
    want = _run(_block(cfg), x, c)
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=-1, exchange="padded", overflow_rounds=2)
    got = _run(_block(cfg, ep), x, c, mesh)
    assert_same_values_and_grads(got, want, "exact buffers")
    assert int(got[1].ep_extra_rounds) == 0 and int(got[1].overflow_tokens) == 0


def test_rounds_must_not_be_negative():
    with pytest.raises(ValueError, match="ep_overflow_rounds=-1 must be >= 0"):
        ep_lib.ExpertParallel(make_mesh(expert=8), overflow_rounds=-1)


def test_random_skew_within_rounds_matches_single_device(rng):
    # expert=4 x fsdp=2 with alignment 2, random skew from random balancing biases (T=4, k=3:
    # even unbiased draws need 1.3-2.7x the balanced buffers, so rounds run). Whenever
    # the load needs at most (rounds + 1) x factor, nothing may overflow and outputs and
    # gradients must equal the single-device block's; beyond that, only the count is checked.
    mesh = make_mesh(fsdp=2, expert=4)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=3, moe_mlp_dim=4, gmm_backend="xla",
                    routed_bias=True, group_alignment=2)
    rounds, factor = 2, 1.0
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=factor, exchange="padded",
                               overflow_rounds=rounds)
    ref, par = _block(cfg), _block(cfg, ep)
    seen_extra = seen_beyond = 0
    for draw in range(4):
        x = jnp.asarray(rng.standard_normal((8, 4, D)), jnp.float32)
        c = jnp.asarray(rng.standard_normal((8, 4, D)), jnp.float32)
        bias = jnp.asarray(rng.standard_normal(8) * rng.choice([0.5, 3.0, 30.0]), jnp.float32)
        want = _run(ref, x, c, bias=bias)
        got = _run(par, x, c, mesh, bias=bias)
        stats = got[1]
        needed = float(stats.buffer_factor_needed)
        if needed <= (rounds + 1) * factor:
            assert int(stats.overflow_tokens) == 0, (draw, needed)
            assert_same_values_and_grads(got, want, f"draw {draw}, needed {needed:.2f}")
        else:
            assert int(stats.overflow_tokens) > 0, (draw, needed)
            seen_beyond += 1
        seen_extra += int(stats.ep_extra_rounds) > 0
    assert seen_extra + seen_beyond > 0, "no draw overflowed one buffer: the test checked nothing new"
