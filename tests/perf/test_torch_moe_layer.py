"""The torch baseline layer of ``moe_layer.py`` (``benchmarks/torch_moe_layer.py``) against a
per-token loop, in float32 on the CPU. Skipped where torch is not installed (CI)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no torch._grouped_mm", allow_module_level=True)

REPO = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("torch_moe_layer",
                                              REPO / "benchmarks" / "torch_moe_layer.py")
tml = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tml)


def slow_reference(layer, x_BSD):
    """The layer's maths one token at a time: its own top-k experts, each a SwiGLU, weighted.

    Written from the definitions (scores, biased selection, renormalised and scaled
    weights), sharing nothing with the layer but its parameters.
    """
    b, s, d = x_BSD.shape
    rows = []
    for x_D in x_BSD.reshape(b * s, d):
        logits_E = x_D @ layer.router_DE
        scores_E = torch.sigmoid(logits_E) if layer.score_func == "sigmoid" else torch.softmax(
            logits_E, -1)
        choice_E = scores_E + layer.bias_E if layer.routed_bias else scores_E
        experts = sorted(range(layer.e), key=lambda e: -float(choice_E[e].detach()))[:layer.k]
        w = torch.stack([scores_E[e] for e in experts])
        if layer.norm_topk_prob:
            w = w / w.sum()
        w = w * layer.scale
        out_D = torch.zeros_like(x_D)
        for j, e in enumerate(experts):
            if layer.layout == "fused":
                f = layer.wo_EFD.shape[1]
                gate, up = layer.wi_ED2F[e][:, :f], layer.wi_ED2F[e][:, f:]
                down = layer.wo_EFD[e]
            else:
                gate, up, down = layer.w1_EFD[e].T, layer.w3_EFD[e].T, layer.w2_EDF[e].T
            out_D = out_D + w[j] * ((torch.nn.functional.silu(x_D @ gate) * (x_D @ up)) @ down)
        if layer.shared is not None:
            sh = layer.shared
            out_D = out_D + (torch.nn.functional.silu(x_D @ sh["gate_DF"])
                             * (x_D @ sh["up_DF"])) @ sh["out_FD"]
        rows.append(out_D)
    return torch.stack(rows).reshape(b, s, d)


def make(layout, score_func="sigmoid", shared=1, bias=None, seed=0):
    layer = tml.TorchMoE(emb_dim=16, moe_mlp_dim=8, num_experts=6, top_k=3, shared_experts=shared,
                         score_func=score_func, norm_topk_prob=True,
                         routed_scaling_factor=2.5 if score_func == "sigmoid" else 1.0,
                         routed_bias=bias is not None, layout=layout, dtype=torch.float32,
                         seed=seed)
    if bias is not None:
        layer.bias_E.copy_(torch.tensor(bias))
    return layer


# Float32 with D = 16, F = 8, K + S = 4 experts: each output element sums a few dozen
# products of O(1) terms, so the two orders of summation differ by ~1e-6 relative;
# 1e-5 leaves room and still fails on any wrong expert, weight or row.
TOL = dict(rtol=1e-5, atol=1e-5)
CASES = {
    "balanced": dict(),
    "softmax, no shared": dict(score_func="softmax", shared=0),
    # Expert 5 never chosen (an empty group) and expert 4 chosen by every token.
    "empty group": dict(bias=[0.0, 0.0, 0.0, 0.0, 10.0, -10.0]),
    # Every token to the same top-3: three full groups, three empty ones.
    "all to one": dict(bias=[10.0, 10.0, 10.0, -10.0, -10.0, -10.0]),
}


@pytest.mark.parametrize("layout", tml.LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_the_per_token_loop(layout, case, rng):
    layer = make(layout, seed=int(rng.integers(1 << 30)), **CASES[case])
    x = torch.from_numpy(rng.standard_normal((2, 20, 16)).astype("float32")).requires_grad_(True)
    g = torch.from_numpy(rng.standard_normal((2, 20, 16)).astype("float32"))
    weights_TK, experts_TK = layer.route(x.reshape(40, 16))
    if case == "empty group":
        assert not (experts_TK == 5).any() and (experts_TK == 4).any(dim=-1).all()
    if case == "all to one":
        assert (experts_TK.sort(-1).values == torch.tensor([0, 1, 2])).all()
    out = layer(x)
    ref = slow_reference(layer, x)
    torch.testing.assert_close(out, ref, **TOL)
    params = [p for p in layer.parameters()] + [x]
    grads = torch.autograd.grad(out, params, g)
    ref_grads = torch.autograd.grad(ref, params, g)
    for p, got, want in zip(params, grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, p=p: f"{tuple(p.shape)}: {m}")


def test_timing_returns_positive_medians():
    layer = make("fused")
    x, g = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    row = tml.time_layer(layer, x, g, quick=True)
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["iters"] == 5
    assert layer.wi_ED2F.grad is not None  # the fwd+bwd timing ran the backward


def test_run_case_builds_the_config_layer_and_frees_it():
    """``moe_layer.py`` hands ``run_case`` a dropless ``MoEConfig``; these are the fields it reads."""
    cfg = SimpleNamespace(moe_mlp_dim=8, num_experts=6, num_experts_per_tok=3, shared_experts=0,
                          routed_score_func="softmax", norm_topk_prob=True,
                          routed_scaling_factor=1.0, routed_bias=False, n_routing_groups=-1)
    shape = {"batch": 1, "seq": 8, "emb_dim": 16}
    row = tml.run_case(cfg, shape, "torchtitan", quick=True)
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["torch_device"] == "cpu"
    with pytest.raises(ValueError, match="group-limited"):
        tml.run_case(SimpleNamespace(**{**vars(cfg), "n_routing_groups": 4}), shape, "fused")


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="layout"):
        tml.TorchMoE(emb_dim=16, moe_mlp_dim=8, num_experts=6, top_k=3, layout="nope")
