"""Expert-parallel MoEBlock on 8 CPU devices against the single-device block.

Legend: B batch, S sequence, T tokens, D model dim, E experts, K experts per
token, R expert ranks, L = E/R experts per rank.

Meshes expert=8, fsdp=2 x expert=4 and data=2 x expert=4, parameters sharded
by ``parallel.sharding``, exchange "padded" (XLA:CPU has no ragged
all-to-all). Outputs and the gradients of the input and of every parameter
must equal the single-device block's to float32 tolerance, for random routing
and for every token sent to rank 0's experts (buffer factor -1). Overflow and
deduplication counts are compared with counts made by hand.
"""


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
CASES = {
    # mesh, config: each mesh with a different block configuration.
    "expert8": (dict(expert=8), MoEConfig(
        num_experts=16, num_experts_per_tok=4, moe_mlp_dim=8, gmm_backend="xla")),
    "fsdp2_expert4": (dict(fsdp=2, expert=4), MoEConfig(
        num_experts=8, num_experts_per_tok=2, moe_mlp_dim=6, gmm_backend="xla",
        prefuse_moe_weights=False, group_alignment=2, routed_score_func="sigmoid",
        n_routing_groups=4, topk_routing_group=2)),
    "data2_expert4": (dict(data=2, expert=4), MoEConfig(
        num_experts=8, num_experts_per_tok=3, moe_mlp_dim=8, gmm_backend="xla",
        shared_experts=1)),
}


def _blocks(mesh, cfg, factor, seed=0, chunks=1):
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=factor, exchange="padded",
                               pipeline_chunks=chunks)
    cfg = cfg.__class__(**{**cfg.__dict__, "routed_bias": True})
    ref = MoEBlock(cfg, emb_dim=D, rngs=nnx.Rngs(seed))
    par = MoEBlock(cfg, emb_dim=D, rngs=nnx.Rngs(seed), ep=ep)
    return ref, par


def _rank0_bias(block, ranks):
    return rank0_bias(block.cfg.num_experts, ranks)


def _grad_fn(block, mesh=None):
    """(jitted (state, x, c) -> (y, stats, (dstate, dx)), the block's state), sharded on mesh."""
    graphdef, state = nnx.split(block)
    if mesh is not None:
        state = jax.device_put(state, sharding.state_shardings(mesh, state))

    def loss(state, x, c):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * c), (y, stats)

    def fn(state, x, c):
        (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            state, x, c)
        return y, stats, grads

    return jax.jit(fn), state


def _with_bias(state, bias):
    state = jax.tree.map(lambda a: a, state)  # a copy of the tree, same arrays
    state["router_bias"] = jax.tree.map(lambda b: jnp.zeros_like(b) + bias, state["router_bias"])
    return state


def _loss_and_grads(block, x_BSD, c_BSD, mesh=None):
    fn, state = _grad_fn(block, mesh)
    if mesh is not None:
        x_BSD = jax.device_put(x_BSD, NamedSharding(mesh, P(sharding.BATCH_AXES)))
    return fn(state, x_BSD, c_BSD)


def hand_dedup_counts(experts_TK, ranks, per_rank, token_rank_T):
    """(rows sent to other ranks, rows per-expert sending adds), by loops."""
    sent = per_expert = 0
    for t, row in enumerate(np.asarray(experts_TK)):
        dests = [int(e) // per_rank for e in row]
        sent += len({q for q in dests if q != token_rank_T[t]})
        per_expert += sum(q != token_rank_T[t] for q in dests)
    return sent, per_expert - sent


def _token_ranks(mesh, tokens):
    """Expert rank of each global token under the (data, fsdp, expert) split."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    return [(t // (tokens // shards)) % mesh.shape["expert"] for t in range(tokens)]


# Each mesh with each chunk count is 9 cases of about 4 s each in one serial subprocess; by
# default every mesh and every chunk count runs once (a Latin square's diagonal, 3 cases),
# the other 6 with DROPLESS_SLOW=1 (CI time).
_EP_DIAGONAL = {("expert8", 1), ("fsdp2_expert4", 2), ("data2_expert4", 4)}
_EP_CASES = [
    pytest.param(case, chunks, marks=() if (case, chunks) in _EP_DIAGONAL else pytest.mark.slow(
        reason="a further mesh x chunks case, left out for CI time"))
    for chunks in (1, 2, 4) for case in CASES
]


@pytest.mark.parametrize("case,chunks", _EP_CASES)
def test_same_values_and_grads_as_single_device(case, chunks, rng):
    """Also with each rank's 4 tokens in 2 or 4 pipeline chunks (``ep_pipeline_chunks``):
    the same values, gradients and counts."""
    mesh_shape, cfg = CASES[case]
    mesh = make_mesh(**mesh_shape)
    ref, par = _blocks(mesh, cfg, factor=-1, chunks=chunks)
    ranks = mesh.shape["expert"]
    ref_fn, ref_state = _grad_fn(ref)
    par_fn, par_state = _grad_fn(par, mesh)
    # Routing is data (the bias): both routings run the same two compiled programs.
    for routing in ("random", "all_to_rank0"):
        bias = _rank0_bias(ref, ranks) if routing == "all_to_rank0" else 0.0
        x = jnp.asarray(rng.standard_normal((8, 4, D)), jnp.float32)
        c = jnp.asarray(rng.standard_normal((8, 4, D)), jnp.float32)
        want = ref_fn(_with_bias(ref_state, bias), x, c)
        xs = jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH_AXES)))
        got = par_fn(_with_bias(par_state, bias), xs, c)
        assert_same_values_and_grads(got, want, routing)
        s0, s1 = want[1], got[1]
        assert int(s1.overflow_tokens) == 0 and int(s0.overflow_tokens) == 0
        np.testing.assert_array_equal(s1.tokens_per_expert, s0.tokens_per_expert)
        # Deduplication counts against a count by hand of the same routing.
        x_TD = x.reshape(-1, D)
        decision = _decision_with_bias(ref, x_TD, bias)
        sent, saved = hand_dedup_counts(decision.experts_TK, ranks, cfg.num_experts // ranks,
                                        _token_ranks(mesh, x_TD.shape[0]))
        assert (int(s1.ep_rows_sent), int(s1.ep_rows_saved)) == (sent, saved), routing
        if routing == "all_to_rank0" and cfg.num_experts_per_tok <= cfg.num_experts // ranks:
            # Every token's K experts sit on rank 0: one row per token off rank 0, and
            # rank 0 holds R times the balanced T*K copies.
            off_rank0 = x_TD.shape[0] - x_TD.shape[0] // ranks
            assert (sent, saved) == (off_rank0, off_rank0 * (cfg.num_experts_per_tok - 1))
            assert float(s1.buffer_factor_needed) == ranks


def _decision_with_bias(block, x_TD, bias):
    graphdef, state = nnx.split(block)
    biased = nnx.merge(graphdef, _with_bias(state, bias))
    return biased._route(x_TD)[1]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("k", [1, 2])
def test_overflow_counted_by_hand(k, chunks):
    # data=2 x expert=4, E=8 (L=2), T=4 tokens per rank, all tokens to rank 0's experts.
    # In 2 pipeline chunks each chunk has half the tokens and half the buffers, so each
    # cuts half the rows below: the totals and the factor needed are the same.
    mesh = make_mesh(data=2, expert=4)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=k, moe_mlp_dim=4, gmm_backend="xla")
    _, par = _blocks(mesh, cfg, factor=1.0, chunks=chunks)
    par.router_bias[...] = _rank0_bias(par, 4)
    x = jax.random.normal(jax.random.key(0), (8, 4, D))
    _, stats, _ = _loss_and_grads(par, x, jnp.ones_like(x), mesh)
    t = 4
    if k == 1:
        # Rank 0 is sent 4 ranks x 4 rows into a buffer of T*min(K,R) = 4: 12 cut, per
        # data group; the 4 that arrive have one copy each and fit (T*K = 4).
        expect, needed = 2 * 3 * t, 4.0
    else:
        # Buffer 8 rows of 16: 8 cut; the 8 that arrive bring 16 copies for an expert
        # buffer of T*K = 8: expert 0 takes all 8 first copies, every row loses its second.
        expect, needed = 2 * (8 + 8), 16 * k / (t * k)
    assert int(stats.overflow_tokens) == expect
    assert float(stats.buffer_factor_needed) == needed


def test_dedup_hand_example():
    # expert=4 (E=8, L=2): tokens 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 2, 6-7 on rank 3.
    mesh = make_mesh(expert=4)
    experts_TK = jnp.array([
        [0, 1, 2],  # rank 0 twice (home), rank 1 once: 1 row out, per-expert 1
        [2, 3, 4],  # rank 1 twice, rank 2 once: 2 rows out, per-expert 3
        [2, 3, 6],  # home rank 1 twice, rank 3: 1 row, per-expert 1
        [0, 6, 7],  # rank 0, rank 3 twice: 2 rows, per-expert 3
        [0, 1, 5],  # rank 0 twice, home: 1 row, per-expert 2
        [6, 7, 4],  # rank 3 twice, home: 1 row, per-expert 2
        [7, 6, 0],  # home twice, rank 0: 1 row, per-expert 1
        [1, 3, 5],  # ranks 0, 1, 2: 3 rows, per-expert 3
    ], jnp.int32)
    weights_TK = jnp.full((8, 3), 0.5, jnp.float32)
    x_TD = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) / 10
    scale_E = jnp.arange(1, 9, dtype=jnp.float32)

    def expert_fn(x_PD, group_sizes_G, weights):
        (scale_G,) = weights
        expert_P = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(x_PD.shape[0]),
                                    side="right")
        live_P = jnp.arange(x_PD.shape[0]) < jnp.sum(group_sizes_G)
        return x_PD * jnp.where(live_P, scale_G.at[expert_P].get(mode="fill", fill_value=0), 0)[:, None]

    ep = ep_lib.ExpertParallel(mesh, buffer_factor=-1, exchange="padded")
    out, stats = jax.jit(lambda *a: ep_lib.routed_experts(
        *a, expert_fn, num_experts=8, ep=ep))(x_TD, experts_TK, weights_TK, (scale_E,))
    assert (int(stats.rows_sent), int(stats.rows_saved)) == (12, 16 - 12)
    assert (12, 4) == hand_dedup_counts(experts_TK, 4, 2, [0, 0, 1, 1, 2, 2, 3, 3])
    expect = x_TD * (0.5 * scale_E[experts_TK].sum(-1))[:, None]
    np.testing.assert_allclose(out, expect, rtol=1e-6)
    assert int(stats.overflow_tokens) == 0


def test_factor_must_be_exact_or_at_least_one():
    with pytest.raises(ValueError, match="must be -1 or >= 1"):
        ep_lib.ExpertParallel(make_mesh(expert=8), buffer_factor=0.5)
    with pytest.raises(ValueError, match="ep_pipeline_chunks=0 must be >= 1"):
        ep_lib.ExpertParallel(make_mesh(expert=8), pipeline_chunks=0)


def test_pipeline_chunks_must_divide_the_tokens_of_a_rank():
    mesh = make_mesh(expert=8)
    _, par = _blocks(mesh, CASES["expert8"][1], factor=-1, chunks=3)
    x = jnp.ones((8, 4, D))  # 4 tokens per rank
    with pytest.raises(ValueError, match="ep_pipeline_chunks=3 does not divide the 4 tokens"):
        _loss_and_grads(par, x, x, mesh)
    with pytest.raises(ValueError, match="not divisible"):
        MoEBlock(MoEConfig(num_experts=12), emb_dim=D, rngs=nnx.Rngs(0),
                 ep=ep_lib.ExpertParallel(make_mesh(expert=8)))


@pytest.mark.parametrize("mesh_shape", [dict(expert=4), dict(data=2, expert=4)],
                         ids=["expert4", "data2_expert4"])
@pytest.mark.parametrize("quantization", ["te_no_quant", "te_fp8_blockwise"])
def test_hopper_kernels_type_check_under_expert_parallelism(mesh_shape, quantization, monkeypatch):
    """What a Hopper GPU runs by default (``gmm_backend=auto`` -> the Mosaic kernels;
    ``te_fp8_blockwise`` -> the FP8 kernels and, for bf16 operands, the Mosaic GPU
    quantizers), traced for
    value and gradients inside expert parallelism's ``shard_map``. Each kernel's
    output must vary over the mesh axes its operands vary over: typed as the same
    on every rank, the backward pass failed to trace (the custom_vjp of the
    combine saw a varying cotangent for an unvarying primal). Tracing needs no
    GPU; the kernels' values are tested on the GPU and in interpret mode."""
    from dropless.ops.gmm import fp8_quant_kernels, mosaic

    monkeypatch.setattr(mosaic, "is_available", lambda: True)
    monkeypatch.setattr(fp8_quant_kernels, "default_interpret", lambda: False)
    mesh = make_mesh(**mesh_shape)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=256, gmm_backend="auto",
                    gmm_quantization=quantization, shared_experts=1)
    ep = ep_lib.ExpertParallel(mesh, buffer_factor=-1, exchange="padded")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MoEBlock(
        cfg, emb_dim=256, rngs=nnx.Rngs(0), ep=ep, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)))

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((8, 64, 256), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(sharding.BATCH_AXES)))
    text = str(jax.jit(jax.grad(loss, argnums=(0, 1))).trace(abstract, x).jaxpr)
    assert "mpmd_map" in text  # the Mosaic GPU kernels were traced, not a fallback
    fp8 = quantization == "te_fp8_blockwise"
    for name in ("gmm_fp8", "tgmm_fp8", "fp8_quantize_weight", "fp8_quantize_rows"):
        assert (f"name={name}" in text) == fp8, name  # the FP8 kernels and their quantizers
    assert "pallas_call" not in text  # no Triton quantizer for bf16 operands
