"""MoEBlock against a naive per-token reference, in values and gradients.

Legend: B batch, S sequence, T = B*S tokens, D model dim, F expert hidden
dim, E experts, K experts per token.

The reference routes each token in float64 NumPy (brute force over groups
and experts), then computes ``sum_j w_j * FFN_{e_j}(x) (+ shared MLP)`` one
token at a time (``vmap`` over a per-token function) in float32 at HIGHEST
precision; the weights ``w_j`` are differentiable functions of the router
kernel, so gradients w.r.t. the input and every parameter can be compared.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dropless.config.sections import MoEConfig
import bf16_bounds
from bf16_bounds import within_bound
from dropless.nn.moe import MoEBlock, MoEStats, RouterBias

HI = jax.lax.Precision.HIGHEST
D = 16
BATCH, SEQ = 2, 6
BASE = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=12, gmm_backend="xla")


def reference_select(p, bias, x_TD, cfg):
    """float64 per-token routing -> (experts [T, K], smallest decision margin)."""
    logits = np.asarray(x_TD, np.float64) @ np.asarray(p["router"]["kernel"], np.float64)
    if cfg.routed_score_func == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    sel = scores + (np.asarray(bias, np.float64) if cfg.routed_bias else 0.0)
    e, k, g = cfg.num_experts, cfg.num_experts_per_tok, cfg.n_routing_groups
    top_g = cfg.topk_routing_group
    experts, margin = [], np.inf
    for row in sel:
        eligible = np.arange(e)
        if g > 1:
            per = e // g
            gs = np.array([np.sort(row[i * per:(i + 1) * per])[::-1][:2].sum() for i in range(g)])
            order = np.argsort(-gs, kind="stable")
            if top_g < g:
                margin = min(margin, gs[order[top_g - 1]] - gs[order[top_g]])
            eligible = np.concatenate([np.arange(i * per, (i + 1) * per) for i in order[:top_g]])
        ranked = eligible[np.argsort(-row[eligible], kind="stable")]
        if k < len(ranked):
            margin = min(margin, row[ranked[k - 1]] - row[ranked[k]])
        experts.append(ranked[:k])
    return np.array(experts, np.int32), margin


def reference_forward(p, x_TD, experts_TK, cfg, keep_TK=None):
    """Per-token ``sum_j w_j FFN_{e_j}(x)`` (+ shared), float32; returns (out, aux)."""
    x_TD = x_TD.astype(jnp.float32)
    logits = jnp.dot(x_TD, p["router"]["kernel"], precision=HI)
    softmax = cfg.routed_score_func == "softmax"
    scores = jax.nn.softmax(logits) if softmax else jax.nn.sigmoid(logits)
    w_TK = jnp.take_along_axis(scores, experts_TK, axis=-1)
    if cfg.norm_topk_prob:
        w_TK = w_TK / w_TK.sum(-1, keepdims=True)
    w_TK = w_TK * cfg.routed_scaling_factor
    if keep_TK is not None:  # capacity path: dropped copies contribute nothing
        w_TK = w_TK * keep_TK
    f = cfg.moe_mlp_dim

    def swiglu(x, w_gate, w_up, w_down):
        h = jax.nn.silu(jnp.dot(x, w_gate, precision=HI)) * jnp.dot(x, w_up, precision=HI)
        return jnp.dot(h, w_down, precision=HI)

    def expert_ffn(e, x_D):
        if cfg.prefuse_moe_weights:
            w_gate, w_up = p["wi"][e][:, :f], p["wi"][e][:, f:]
        else:
            w_gate, w_up = p["wi_0"][e], p["wi_1"][e]
        return swiglu(x_D, w_gate, w_up, p["wo"][e])

    def one_token(x_D, e_K, w_K):
        return sum(w_K[j] * expert_ffn(e_K[j], x_D) for j in range(e_K.shape[0]))

    out = jax.vmap(one_token)(x_TD, experts_TK, w_TK)
    if cfg.shared_experts:
        s = p["shared_experts"]
        out = out + swiglu(x_TD, s["wi_0"]["kernel"], s["wi_1"]["kernel"], s["wo"]["kernel"])
    return out, reference_aux(logits, scores, experts_TK, cfg)


def reference_aux(logits, scores, experts_TK, cfg):
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    probs = scores / scores.sum(-1, keepdims=True)
    f = jnp.bincount(experts_TK.ravel(), length=e) / experts_TK.size
    lb = e * jnp.sum(f * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    seq = 0.0
    for b in range(BATCH):  # sequence-wise: one balance term per sequence
        rows = slice(b * SEQ, (b + 1) * SEQ)
        f_b = jnp.bincount(experts_TK[rows].ravel(), length=e) * e / (k * SEQ)
        seq = seq + jnp.sum(f_b * probs[rows].mean(0)) / BATCH
    return (cfg.load_balance_loss_weight * lb + cfg.seq_aux_loss_weight * seq
            + cfg.router_z_loss_weight * z)


def build(cfg, rng, dtype=jnp.float32, bias=None):
    block = MoEBlock(cfg, emb_dim=D, dtype=dtype, rngs=nnx.Rngs(int(rng.integers(1 << 31))))
    if bias is not None:
        block.router_bias[...] = jnp.asarray(bias, jnp.float32)
    return block


def draw_input(block, cfg, rng):
    """Random x whose routing has no near-ties (so float32 and float64 agree)."""
    p = nnx.to_pure_dict(nnx.state(block, nnx.Param))
    for _ in range(50):
        x = rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
        experts, margin = reference_select(p, block.router_bias[...], x.reshape(-1, D), cfg)
        if margin > 1e-4:
            return jnp.asarray(x), jnp.asarray(experts)
    raise AssertionError("could not draw an input without routing near-ties")


def block_loss_and_grads(block, x, c):
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    @jax.jit
    def run(params, x):
        def loss(params, x):
            y, stats = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y.astype(jnp.float32) * c) + stats.aux_loss, (y, stats)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (_, (y, stats)), (g_params, g_x) = run(params, x)
    return y, stats, nnx.to_pure_dict(g_params), g_x


def reference_loss_and_grads(block, x, experts, cfg, c, keep=None):
    p = nnx.to_pure_dict(nnx.state(block, nnx.Param))

    @jax.jit
    def run(p, x):
        def loss(p, x):
            out, aux = reference_forward(p, x.reshape(-1, D), experts, cfg, keep)
            return jnp.sum(out.reshape(x.shape) * c) + aux, out.reshape(x.shape)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)

    (_, y), (g_p, g_x) = run(p, x)
    return y, g_p, g_x


def assert_close(got, want, tol, what):
    """max |got - want| <= tol * max(1, max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = np.max(np.abs(got - want)) if got.size else 0.0
    assert err <= tol * max(1.0, np.max(np.abs(want))), f"{what}: max err {err}"


def check_against_reference(cfg, rng, tol=2e-5, bias=None, keep_fn=None):
    block = build(cfg, rng, jnp.float32, bias)
    x, experts = draw_input(block, cfg, rng)
    keep = None if keep_fn is None else keep_fn(np.asarray(experts))
    c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    y, stats, g_params, g_x = block_loss_and_grads(block, x, c)
    y_ref, g_ref, g_x_ref = reference_loss_and_grads(
        block, x, experts, cfg, c, None if keep is None else jnp.asarray(keep, jnp.float32)
    )
    assert y.dtype == jnp.float32 and y.shape == x.shape
    assert_close(y, y_ref, tol, "output")
    assert_close(g_x, g_x_ref, tol, "d/dx")
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(g_ref)[0])
    flat = dict(jax.tree_util.tree_flatten_with_path(g_params)[0])
    assert flat.keys() == flat_ref.keys()
    for path, g in flat.items():
        assert np.any(np.asarray(flat_ref[path]) != 0), f"{path} has no reference gradient"
        assert_close(g, flat_ref[path], tol, f"d/d{jax.tree_util.keystr(path)}")
    counts = np.bincount(np.asarray(experts).ravel(), minlength=cfg.num_experts)
    np.testing.assert_array_equal(stats.tokens_per_expert, counts)
    return block, x, experts, stats


GROUPED = dict(routed_score_func="sigmoid", n_routing_groups=4, topk_routing_group=2,
               routed_scaling_factor=2.5, routed_bias=True, routed_bias_update_rate=1e-3)
CASES = {
    "softmax_prefused": dict(),
    "softmax_separate_shared": dict(prefuse_moe_weights=False, shared_experts=2),
    "softmax_unnormalised_k3": dict(num_experts_per_tok=3, norm_topk_prob=False),
    "sigmoid_grouped_shared_aux": dict(
        GROUPED, shared_experts=1, load_balance_loss_weight=0.1, seq_aux_loss_weight=0.1,
        router_z_loss_weight=0.01),
    "sigmoid_grouped_aligned_separate": dict(GROUPED, group_alignment=4, prefuse_moe_weights=False),
    "softmax_aligned64_shared": dict(group_alignment=64, shared_experts=1),  # moe_group_alignment=64
    "reference_backend": dict(gmm_backend="reference", shared_experts=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float32_matches_reference(name, rng):
    cfg = dataclasses.replace(BASE, **CASES[name])
    bias = rng.standard_normal(cfg.num_experts) * 0.1 if cfg.routed_bias else None
    _, _, _, stats = check_against_reference(cfg, rng, bias=bias)
    assert int(stats.dropped_tokens) == 0


@pytest.mark.parametrize("routed_bias", [True, False])
def test_update_router_bias_takes_one_sign_step(routed_bias):
    """bias += rate * sign(mean_load - load) with ``routed_bias``; untouched without.

    rate * (+-1 or 0) is exact in float32 and the bias starts at 0, so equality is exact.
    """
    rate = 1e-3 if routed_bias else 0.0
    cfg = dataclasses.replace(BASE, **{**GROUPED, "routed_bias": routed_bias, "routed_bias_update_rate": rate})
    block = MoEBlock(cfg, emb_dim=16, rngs=nnx.Rngs(0))
    load = np.array([9, 1, 4, 4, 0, 6, 4, 4])  # mean 4
    block.update_router_bias(jnp.asarray(load, jnp.int32))
    expected = np.float32(rate) * np.sign(4 - load).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(block.router_bias[...]), expected)
    if routed_bias:
        assert np.count_nonzero(expected) == 4


@pytest.mark.parametrize("name", ["softmax_separate_shared", "sigmoid_grouped_shared_aux"])
def test_bf16_within_derived_bound_of_float32_reference(name, rng):
    """bf16 block vs the float32 reference: output, d/dx and every parameter gradient
    within an elementwise bound derived from the arithmetic of both programs.

    Derivation (``tests/nn/bf16_bounds.py`` holds the rules): ``error_bounds``
    walks the jaxpr of the block's forward *and* backward pass (as jit runs it)
    and carries, for every intermediate, a bound on its distance from the same
    program in exact arithmetic. What the block rounds to bf16 (u = 2^-8): x
    (the router still takes float32 x), the expert and shared weights, each
    grouped/dense matmul's output (accumulated in float32), silu's sigmoid, its
    products, the routed combine, the routed + shared sum; in the backward the
    cotangent ``c`` (float32 random) as it enters the bf16 output, each dgrad
    and wgrad matmul's output and the elementwise products of silu's VJP. The
    router, the routing weights, the combine's weights and its dweights einsum,
    and the aux losses stay float32 (u32 = 2^-24 per op); float32 accumulation
    of K terms adds gamma_K(u32) sum |a||b| (K <= 24 here: under 2e-6 of the
    magnitudes, negligible next to u but carried). Each rounding costs at most
    c |v|, propagated through |W| of matmuls and max |f'| of elementwise
    functions; second-order terms (eA eB, (1 + c) e) are carried, so the bound
    is an inequality, not a first-order estimate. The float32 reference gets
    its own bound the same way; |got - want| <= both bounds summed. The slack
    factor (1 + 2^-20) covers the float64 evaluation of the bounds (relative
    error ~ 1e3 ops x 2^-53 < 2^-40). Assumed, not derived: XLA's float32
    exp/log/logistic within 4 ulps; routing decisions agree (``draw_input``
    keeps a float64 margin > 1e-4, far above float32 logit error).

    It is a worst case: the measured error stays well inside (the printed
    ratio; about 0.05-0.2 for the output and the expert gradients). For the
    router kernel the worst case is larger than the gradient itself (the
    router gradient is a difference of bf16-rounded ``<FFN_j(x), dy>`` terms,
    summed over tokens): the bound holds but checks only the size of the error
    there, while ``test_float32_matches_reference`` checks its value.
    """
    cfg = dataclasses.replace(BASE, **CASES[name])
    bias = rng.standard_normal(cfg.num_experts) * 0.1 if cfg.routed_bias else None
    block = build(cfg, rng, jnp.bfloat16, bias)
    x, experts = draw_input(block, cfg, rng)
    c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    p = nnx.to_pure_dict(params)

    def block_fn(params, x):
        def loss(params, x):
            y, stats = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y.astype(jnp.float32) * c) + stats.aux_loss, (y, stats.tokens_per_expert)
        (_, (y, load)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, load, grads

    def reference_fn(p, x):
        def loss(p, x):
            out, aux = reference_forward(p, x.reshape(-1, D), experts, cfg)
            return jnp.sum(out.reshape(x.shape) * c) + aux, out.reshape(x.shape)
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)
        return y, grads

    y, load, (g_params, g_x) = jax.jit(block_fn)(params, x)
    np.testing.assert_array_equal(load, np.bincount(np.asarray(experts).ravel(),
                                                    minlength=cfg.num_experts))
    assert y.dtype == jnp.bfloat16
    exact, (e_y, _, (e_params, e_x)) = bf16_bounds.error_bounds(block_fn, params, x)
    y_ref, (g_ref, g_x_ref) = jax.jit(reference_fn)(p, x)
    exact_ref, (e_y_ref, (e_ref, e_x_ref)) = bf16_bounds.error_bounds(reference_fn, p, x)
    slack = 1 + 2.0**-20
    # Both programs in float64 compute the same function: every local error
    # coefficient of the bounds (>= u32 wherever nonzero) becomes u64 = 2^-53,
    # so they agree within 2^-29 of the bounds summed; 2^-28 allows for the
    # second-order terms and float64's own transcendental ulps. This catches a
    # wrong program (a dropped term, a perturbed weight) far below bf16's noise.
    # Not for the router kernel: the two programs' aux losses hold different
    # float32-rounded constants (1/n of a mean, ...), a difference of ~u32 of the
    # aux gradient that this scaled bound does not carry (it treats literals as exact).
    f64 = lambda got, want, b, b_ref, what: within_bound(got, want, (b + b_ref) * 2.0**-28, what)  # noqa: E731
    f64(exact[0], exact_ref[0], e_y, e_y_ref, "float64 output")
    f64(exact[2][1], exact_ref[1][1], e_x, e_x_ref, "float64 d/dx")
    ratios = {"output": within_bound(y, y_ref, (e_y + e_y_ref) * slack, "output"),
              "d/dx": within_bound(g_x, g_x_ref, (e_x + e_x_ref) * slack, "d/dx")}
    flat = lambda tree: dict(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0])  # noqa: E731
    got, bound = flat(g_params), flat(e_params)
    want = dict(jax.tree_util.tree_flatten_with_path(g_ref)[0])
    bound_ref = dict(jax.tree_util.tree_flatten_with_path(e_ref)[0])
    exact_params = flat(exact[2][0])
    exact_want = dict(jax.tree_util.tree_flatten_with_path(exact_ref[1][0])[0])
    assert got.keys() == want.keys()
    for path in got:
        name_ = "d/d" + jax.tree_util.keystr(path)
        ratios[name_] = within_bound(got[path], want[path], (bound[path] + bound_ref[path]) * slack,
                                     name_)
        if "router" not in name_:  # its aux-loss part holds float32-rounded constants
            f64(exact_params[path], exact_want[path], bound[path], bound_ref[path], "float64 " + name_)
    print(" ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


@pytest.mark.parametrize("k, hot", [(1, [3]), (2, [0, 5])])
def test_extreme_imbalance_drops_nothing(k, hot, rng):
    """A huge bias sends every token to the same experts; dropless keeps them all."""
    cfg = dataclasses.replace(BASE, **GROUPED, num_experts_per_tok=k, shared_experts=1)
    cfg = dataclasses.replace(cfg, n_routing_groups=-1, topk_routing_group=-1)
    bias = np.zeros(cfg.num_experts)
    bias[hot] = 10.0
    _, _, experts, stats = check_against_reference(cfg, rng, bias=bias)
    assert sorted(set(np.asarray(experts).ravel().tolist())) == hot
    expected = np.zeros(cfg.num_experts, np.int32)
    expected[hot] = BATCH * SEQ
    np.testing.assert_array_equal(stats.tokens_per_expert, expected)
    assert int(stats.dropped_tokens) == 0


def queue_keep(experts_TK, num_experts, capacity):
    """Hand computation: copies queue per expert in (token, slot) order."""
    seen = np.zeros(num_experts, np.int64)
    keep = np.zeros(experts_TK.shape, np.float32)
    for t in range(experts_TK.shape[0]):
        for j in range(experts_TK.shape[1]):
            e = experts_TK[t, j]
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    return keep


def test_capacity_drops_exactly_the_copies_past_capacity(rng):
    # Capacity 2 per expert: 16 places for 24 copies, so at least 8 are dropped.
    cfg = dataclasses.replace(BASE, sparse_matmul=False, capacity_factor=0.5, shared_experts=1)
    capacity = math.ceil(0.5 * BATCH * SEQ * cfg.num_experts_per_tok / cfg.num_experts)
    keep_fn = lambda experts: queue_keep(experts, cfg.num_experts, capacity)  # noqa: E731
    _, _, experts, stats = check_against_reference(cfg, rng, keep_fn=keep_fn)
    dropped = int((keep_fn(np.asarray(experts)) == 0).sum())
    assert dropped >= 8 and int(stats.dropped_tokens) == dropped


def test_capacity_hand_example():
    """8 tokens, top-1 of 4 experts, capacity 2: tokens 2, 5 and 7 overflow."""
    routes = np.array([0, 0, 0, 1, 2, 0, 1, 1])
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=1, moe_mlp_dim=8,
                    sparse_matmul=False, capacity_factor=1.0)
    block = MoEBlock(cfg, emb_dim=D, rngs=nnx.Rngs(0))
    kernel = np.zeros((D, 4), np.float32)
    kernel[:4, :4] = np.eye(4)
    block.router.kernel[...] = jnp.asarray(kernel)
    x = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32) * 0.1
    x[:, :4] += 4.0 * np.eye(4)[routes]  # logit margin 4 for the intended expert
    y, stats = nnx.jit(lambda block, x: block(x))(block, jnp.asarray(x).reshape(2, 4, D))
    assert int(stats.dropped_tokens) == 3
    np.testing.assert_array_equal(stats.tokens_per_expert, [4, 3, 1, 0])
    y = np.asarray(y).reshape(8, D)
    np.testing.assert_array_equal(y[[2, 5, 7]], 0.0)
    p = nnx.to_pure_dict(nnx.state(block, nnx.Param))
    forward = jax.jit(reference_forward, static_argnames="cfg")
    y_ref, _ = forward(p, jnp.asarray(x), jnp.asarray(routes[:, None]), cfg=cfg)
    kept = [0, 1, 3, 4, 6]
    np.testing.assert_allclose(y[kept], np.asarray(y_ref)[kept], rtol=1e-5, atol=1e-6)


def test_capacity_path_with_room_equals_dropless(rng):
    cfg = dataclasses.replace(BASE, shared_experts=1)
    dropless = build(cfg, rng)
    baseline = MoEBlock(dataclasses.replace(cfg, sparse_matmul=False, capacity_factor=4.0),
                        emb_dim=D, rngs=nnx.Rngs(0))
    nnx.update(baseline, nnx.state(dropless))
    x = jnp.asarray(rng.standard_normal((BATCH, SEQ, D)), jnp.float32)
    apply = nnx.jit(lambda block, x: block(x))
    (y0, s0), (y1, s1) = apply(dropless, x), apply(baseline, x)
    assert int(s1.dropped_tokens) == 0
    np.testing.assert_array_equal(s0.tokens_per_expert, s1.tokens_per_expert)
    np.testing.assert_allclose(y0, y1, rtol=1e-5, atol=1e-5)


def test_checkpoint_names_and_state_layout(rng):
    block = build(dataclasses.replace(BASE, shared_experts=1), rng)
    jaxpr = str(jax.make_jaxpr(lambda x: block(x))(jnp.zeros((1, 4, D))))
    for name in ("moe_mlpwi", "moe_mlpwo"):
        assert f"name={name}" in jaxpr
    params = nnx.to_pure_dict(nnx.state(block, nnx.Param))
    assert set(params) == {"router", "wi", "wo", "shared_experts"}
    assert params["wi"].shape == (8, D, 24) and params["wo"].shape == (8, 12, D)
    assert list(nnx.to_pure_dict(nnx.state(block, RouterBias))) == ["router_bias"]
    y, stats = block(jnp.zeros((1, 4, D)))
    assert isinstance(stats, MoEStats)
    assert stats.tokens_per_expert.dtype == jnp.int32 and stats.aux_loss.dtype == jnp.float32


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_experts_per_tok=9), "top-k"),
        (dict(n_routing_groups=3, topk_routing_group=1), "divisor"),
        (dict(routed_score_func="relu"), "routed_score_func"),
        (dict(gmm_backend="cutlass"), "gmm_backend"),
        (dict(gmm_quantization="te_fp4"), "gmm_quantization"),
        (dict(gmm_quantization="te_mxfp8", sparse_matmul=False), "capacity baseline"),
        (dict(group_alignment=0), "group_alignment"),
        (dict(sparse_matmul=False, capacity_factor=0.0), "capacity_factor"),
    ],
)
def test_bad_config_raises(changes, match):
    with pytest.raises(ValueError, match=match):
        MoEBlock(dataclasses.replace(BASE, **changes), emb_dim=D, rngs=nnx.Rngs(0))


def test_bad_input_shape_raises_at_trace_time():
    block = MoEBlock(BASE, emb_dim=D, rngs=nnx.Rngs(0))
    for shape in [(2, 3, D + 1), (6, D)]:
        with pytest.raises(ValueError, match="expected"):
            jax.eval_shape(lambda x: block(x), jax.ShapeDtypeStruct(shape, jnp.float32))
