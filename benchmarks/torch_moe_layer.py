"""A plain PyTorch MoE layer on ``torch._grouped_mm``: the baseline ``moe_layer.py`` times in its run.

Legend: B batch, S sequence, T = B*S tokens, D model dim, F expert hidden dim,
E routed experts, K experts per token, P = T*K rows of the expert-sorted buffer.

The layer is torchtitan's grouped-GEMM MoE (``torchtitan/models/moe/moe.py``:
``TokenChoiceTopKRouter`` -> ``TokenReorderer`` -> ``GroupedExperts`` with
``_run_experts_grouped_mm`` -> ``scatter_add`` combine, plus a ``FeedForward``
shared expert), written out here because the GPU machine has torch but not
torchtitan::

    scores_TE = sigmoid | softmax(x_TD @ router_DE)            float32
    experts_TK = topk(scores_TE + bias_E)                      (bias: selection only)
    weights_TK = scores at experts_TK [/ their sum] * routed_scaling_factor
    order_P = argsort(experts_TK.flatten(), stable)            permutation by expert
    offs_E = cumsum(tokens per expert)                         int32 group ends
    x_PD = x_TD[order_P // K]
    h = torch._grouped_mm(x_PD, w_gate|up, offs=offs_E)        [P, 2F] (or two [P, F])
    y_PD = torch._grouped_mm(silu(gate) * up, w_down, offs=offs_E)
    out_TD = sum of weights * y_PD scattered back to tokens    + shared expert(x_TD)

Two weight layouts (``LAYOUTS``):
- ``fused``: gate|up in one [E, D, 2F] row-major weight, two grouped GEMMs per
  pass (as dropless fuses them), ``index_add_`` combine.
- ``torchtitan``: torchtitan's own layout and calls: ``w1``, ``w3`` [E, F, D] and
  ``w2`` [E, D, F] passed transposed (column-major operands), three grouped
  GEMMs, the gather by an expanded index and ``scatter_add`` combine, a bf16
  router ``Linear``. torchtitan pads each expert's rows to a multiple of 8 (16
  for FP8) with a Triton permutation kernel when expert parallelism is off; that
  pad is left out here (``torch._grouped_mm`` takes any bf16 group sizes), so
  this is an upper bound on its speed.

Routing follows the same rule as dropless's ``ops.routing.route``: ties in
top-k may break differently, which random data never hits. No auxiliary loss is
computed (torchtitan computes none in the layer; dropless's timed layer adds
DeepSeek-V3's sequence aux loss, a few [T, E] float32 passes).

``torch._grouped_mm`` computes bf16 on CUDA (SM >= 80) and, in torch >= 2.9,
float32 on the CPU too, which the CPU test uses; the backward (dgrad and the
2D x 2D wgrad with ``offs``) is torch's. Nothing here imports jax or dropless:
``moe_layer.py`` loads this file lazily, and the test runs it without jax.
"""

import gc
import math
import statistics
import time

import torch
import torch.nn.functional as F

LAYOUTS = ("fused", "torchtitan")


def grouped_mm(x_PK, w_EKN, offs_E):
    """Rows ``offs_E[e-1]:offs_E[e]`` of ``x_PK`` times ``w_EKN[e]``: [P, K] x [E, K, N] -> [P, N]."""
    return torch._grouped_mm(x_PK, w_EKN, offs=offs_E)


class TorchMoE(torch.nn.Module):
    """Routed SwiGLU experts on ``torch._grouped_mm`` plus an optional shared expert.

    Args:
      emb_dim, moe_mlp_dim, num_experts, top_k, shared_experts: D, F, E, K, S.
      score_func: "sigmoid" | "softmax"; norm_topk_prob: renormalise the K weights;
      routed_scaling_factor: multiplies them; routed_bias: an [E] float32
      selection bias (``bias_E``, zeros unless set) takes part in top-k.
      layout: one of ``LAYOUTS`` (module docstring).
      dtype, device: of parameters and activations (the router math is float32).

    Raises:
      ValueError: an unknown layout or score_func, or top_k > num_experts.
    """

    def __init__(self, *, emb_dim, moe_mlp_dim, num_experts, top_k, shared_experts=0,
                 score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0,
                 routed_bias=False, layout="fused", dtype=torch.bfloat16, device="cpu", seed=0):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"{layout=} is not one of {LAYOUTS}")
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"{score_func=} is not one of ('sigmoid', 'softmax')")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{top_k=} must be in [1, {num_experts=}]")
        d, f, e, sf = emb_dim, moe_mlp_dim, num_experts, shared_experts * moe_mlp_dim
        self.k, self.e, self.layout = top_k, e, layout
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.scale, self.routed_bias = routed_scaling_factor, routed_bias
        gen = torch.Generator().manual_seed(seed)

        def param(*shape, fan_in):
            w = torch.randn(*shape, generator=gen) / math.sqrt(fan_in)
            return torch.nn.Parameter(w.to(device=device, dtype=dtype))

        self.router_DE = param(d, e, fan_in=d)
        self.register_buffer("bias_E", torch.zeros(e, device=device))
        if layout == "fused":
            self.wi_ED2F = param(e, d, 2 * f, fan_in=d)
            self.wo_EFD = param(e, f, d, fan_in=f)
        else:  # torchtitan's GroupedExperts: w1, w3 [E, F, D], w2 [E, D, F]
            self.w1_EFD, self.w3_EFD = param(e, f, d, fan_in=d), param(e, f, d, fan_in=d)
            self.w2_EDF = param(e, d, f, fan_in=f)
        self.shared = None
        if sf:
            self.shared = torch.nn.ParameterDict({
                "gate_DF": param(d, sf, fan_in=d), "up_DF": param(d, sf, fan_in=d),
                "out_FD": param(sf, d, fan_in=sf)})

    def route(self, x_TD):
        """``(weights_TK float32, experts_TK int64)`` for tokens ``x_TD``."""
        if self.layout == "torchtitan":  # its router is a bf16 Linear, scored in float32
            logits_TE = (x_TD @ self.router_DE).float()
        else:
            logits_TE = x_TD.float() @ self.router_DE.float()
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        else:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        selection_TE = scores_TE + self.bias_E if self.routed_bias else scores_TE
        experts_TK = torch.topk(selection_TE.detach(), self.k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return weights_TK * self.scale, experts_TK

    def _shared(self, x_TD):
        s = self.shared
        return (F.silu(x_TD @ s["gate_DF"]) * (x_TD @ s["up_DF"])) @ s["out_FD"]

    def forward(self, x_BSD):
        """[B, S, D] -> [B, S, D] in the parameters' dtype."""
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        weights_TK, experts_TK = self.route(x_TD)
        flat_P = experts_TK.reshape(-1)
        # Counts by scatter, not bincount: bincount sizes its output on the host (a sync).
        counts_E = torch.zeros(self.e, dtype=torch.int32, device=x_TD.device)
        counts_E.scatter_add_(0, flat_P, torch.ones_like(flat_P, dtype=torch.int32))
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        order_P = torch.argsort(flat_P, stable=True)
        token_P = order_P // self.k
        weight_P1 = weights_TK.reshape(-1)[order_P].unsqueeze(-1)
        if self.layout == "fused":
            x_PD = x_TD[token_P]
            gate_PF, up_PF = grouped_mm(x_PD, self.wi_ED2F, offs_E).chunk(2, dim=-1)
            y_PD = grouped_mm(F.silu(gate_PF) * up_PF, self.wo_EFD, offs_E)
            y_PD = (y_PD.float() * weight_P1).to(x_TD.dtype)
            out_TD = torch.zeros_like(x_TD).index_add_(0, token_P, y_PD)
            return (out_TD + self._shared(x_TD) if self.shared is not None else out_TD).reshape(b, s, d)
        index_PD = token_P.reshape(-1, 1).expand(-1, d)
        x_PD = torch.gather(x_TD, 0, index_PD)
        h_PF = F.silu(grouped_mm(x_PD, self.w1_EFD.transpose(-2, -1), offs_E))
        h_PF = h_PF * grouped_mm(x_PD, self.w3_EFD.transpose(-2, -1), offs_E)
        y_PD = grouped_mm(h_PF, self.w2_EDF.transpose(-2, -1), offs_E)
        out_TD = self._shared(x_TD) if self.shared is not None else torch.zeros_like(x_TD)
        y_PD = (y_PD.float() * weight_P1).to(x_TD.dtype)
        return out_TD.scatter_add(0, index_PD, y_PD).reshape(b, s, d)


def from_moe_config(cfg, emb_dim, layout="fused", dtype=torch.bfloat16, device="cpu", seed=0):
    """A ``TorchMoE`` with the routing and sizes of a dropless ``MoEConfig`` (read by attribute).

    Raises:
      ValueError: the config uses group-limited routing (not implemented here).
    """
    if cfg.n_routing_groups > 1:
        raise ValueError(f"{cfg.n_routing_groups=}: the torch layer has no group-limited routing")
    return TorchMoE(emb_dim=emb_dim, moe_mlp_dim=cfg.moe_mlp_dim, num_experts=cfg.num_experts,
                    top_k=cfg.num_experts_per_tok, shared_experts=cfg.shared_experts,
                    score_func=cfg.routed_score_func, norm_topk_prob=cfg.norm_topk_prob,
                    routed_scaling_factor=cfg.routed_scaling_factor, routed_bias=cfg.routed_bias,
                    layout=layout, dtype=dtype, device=device, seed=seed)


def _median_ms(fn, warmup, iters, device):
    """Median milliseconds of ``fn()``: CUDA events around each call on a GPU, else wall time."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_layer(layer, x_BSD, g_BSD, quick=False) -> dict:
    """Fwd (no autograd graph) and fwd+bwd (grads of params and x for cotangent ``g_BSD``) times.

    Returns ``{"fwd_ms", "fwd_bwd_ms", "iters", "warmup"}``: medians over ``iters`` calls
    after ``warmup`` calls (allocator growth, cuBLAS heuristics).
    """
    warmup, iters = (2, 5) if quick else (3, 10)
    params = [p for p in layer.parameters()]
    x_BSD = x_BSD.detach().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return layer(x_BSD)

    def fwd_bwd():
        for t in (*params, x_BSD):
            t.grad = None
        layer(x_BSD).backward(g_BSD)

    return {"fwd_ms": _median_ms(fwd, warmup, iters, x_BSD.device),
            "fwd_bwd_ms": _median_ms(fwd_bwd, warmup, iters, x_BSD.device),
            "iters": iters, "warmup": warmup}


def run_case(cfg, shape, layout, quick=False, seed=0) -> dict:
    """Build the layer of ``cfg`` at ``shape`` (moe_layer.py's dict) on CUDA in bf16 if there
    is a GPU (float32 on the CPU, where ``torch._grouped_mm`` has no bf16 path for every
    shape), time it, free its memory, and return the timings with the device and dtype.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = from_moe_config(cfg, shape["emb_dim"], layout=layout, dtype=dtype, device=device,
                            seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    b, s, d = shape["batch"], shape["seq"], shape["emb_dim"]
    x = torch.randn(b, s, d, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(b, s, d, generator=gen).to(device=device, dtype=dtype)
    try:
        row = time_layer(layer, x, g, quick)
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        del layer, x, g
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory back before jax's cases
            torch.cuda.reset_peak_memory_stats()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {**row, "torch": torch.__version__, "torch_device": name, "torch_dtype": str(dtype)}
