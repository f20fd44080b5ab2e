"""MoE layer benchmark: one DeepSeek-V3 MoE layer on one GPU, ours vs the baselines.

    PYTHONPATH=src python3 benchmarks/moe_layer.py [--quick] [--out DIR]    # GPU, ~3-5 min
    PYTHONPATH=src python3 benchmarks/moe_layer.py --shape qwen3-30b        # Qwen3-30B-A3B's layer
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/moe_layer.py --tiny # CPU smoke run

Shape (DeepSeek-V3 with 8-way expert parallelism, the local half of one layer):
T = 8192 tokens (2 x 4096), D = 7168, F = 2048 (``moe_mlp_dim``), E = 32 local
experts, K = 8 per token, S = 1 shared expert, bf16 parameters and
activations; sigmoid routing with the balancing bias and the sequence aux
loss, as in V3 (no group limit: V3 limits groups over all 256 experts, before
the exchange). Random data, router weights random, so the load is roughly
balanced.

The layer's config comes from the loader ``dropless train`` uses:
``model_name=deepseek3-proxy`` plus overrides (``BASE``; ``--tiny``:
``deepseek3-tiny``, ``TINY_BASE``), each case adding its own; every row
records its overrides.

``--shape qwen3-30b``: Qwen3-30B-A3B's whole layer (``model_name=qwen3-moe-proxy``, ``QWEN3_BASE``: T = 16384,
D = 2048, F = 768, E = 128, K = 8, no shared expert, softmax routing; its
expert GEMMs have K or N = 768). The recorded torchtitan figure
(``TARGETS``, from an earlier run) is for the DeepSeek shape only; the torch
cases run at both.

Cases: ``ours`` (dropless, ``gmm_backend=auto``: our Mosaic kernels on
Hopper), ``xla`` (dropless through ``lax.ragged_dot``), and MaxText's
capacity-limited ``dense_matmul`` baseline at capacity factors 1.0 and 1.25
(it drops tokens; the fraction is reported). The torch cases (``TORCH_CASES``,
``torch_moe_layer.py``) time a plain PyTorch layer with the same routing and
sizes whose expert GEMMs are ``torch._grouped_mm``, in the same process on the
same GPU, so each case's ratio to torch comes from one run:
``torch_grouped_mm`` (gate|up fused, as ours) and ``torchtitan_ref``
(torchtitan's grouped-mm MoE, its layout and calls, without its group padding).
They run first, and hand their memory back before jax's cases; run as a script,
this file turns jax's preallocation off (``XLA_PYTHON_CLIENT_PREALLOCATE=false``
unless set) so the two share the GPU. Without torch they record an error row.

A case that cannot fit the device is skipped before it is built (``skip_row``):
its row in the record and the table says why, and a line is printed. Only the
``lax.ragged_dot`` path has a bound (``ragged_dot_fwd_bwd_bytes``): XLA expands
it into dense products over the experts, and at the Qwen3-30B shape one dot
of the weight gradient needs 112.8 GiB, more than JAX's allocator may take of
an H200 (105 GiB at the default memory fraction). XLA's compiled memory
analysis cannot decide this: on the GPU the compile itself is what ran out of
memory (its autotuner allocates the operands), and a CPU compile of the same
program reports 173 GiB of temporaries at the DeepSeek shape, where the GPU's
asked for 88.2 GiB.

Expert FLOPs (the convention of torchtitan's 447 TF/s at 43.6 ms on this
shape): each token visits K routed + S shared SwiGLU experts of 3 matrices
D x F, so ``fwd = 2 * T * (K + S) * 3 * D * F`` = 6.49 TFLOP and
``fwd+bwd = 3 * fwd`` = 19.5 TFLOP. The router (2*T*D*E) is left out. The
capacity baseline is credited with the same useful FLOPs, whatever it computes.

Time split of ours into router (scores, top-k, weights, aux loss), permute
(plan + gather), gmm (gate|up gmm, SwiGLU, down gmm), combine (weighted
inverse permutation) and shared expert: each piece is the block's own code
(``MoEBlock._route``, ``moe.dispatch``, ``MoEBlock._experts_sparse``,
``moe.combine``, ``MoEBlock.shared_experts``) jitted alone, forward and
forward+backward (``jax.vjp`` with random cotangents), on the inputs the
previous pieces produce. A profiler trace of the whole layer's fwd+bwd gives
the kernel-category view next to it.

Targets (``TARGETS``): fwd+bwd <= 28.5 ms on one H200 (issue 15; 36 ms
before); router + permute + combine < 15% of the layer's fwd+bwd time. Timing: ``dropless.perf.measure.time_fn``
(warm-up, back-to-back calls, ``block_until_ready``, median). Writes
``<out>/moe_layer-<time>-<gpu>.json`` and prints the tables, the main one last.
"""

import argparse
import gc
import gzip
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # before jax starts: torch's cases share the GPU with jax's
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
from flax import nnx

from dropless.config.sections import MoEConfig
from dropless.nn import moe
from dropless.ops import permute as permute_ops
from dropless.ops.gmm import resolve_backend
from dropless.perf import hlo as hlo_lib
from dropless.perf import measure

# The layer is the preset's, through the same loader as ``dropless train``: the
# proxy's MoE (DeepSeek-V3's expert shape, 32 local experts) without the group
# limit, with V3's sequence aux loss; a case adds its overrides.
BASE = ["model_name=deepseek3-proxy", "n_routing_groups=-1", "topk_routing_group=-1",
        "seq_aux_loss_weight=1e-4"]
TINY_BASE = ["model_name=deepseek3-tiny", "n_routing_groups=-1", "topk_routing_group=-1",
             "seq_aux_loss_weight=1e-4", "per_device_batch_size=2", "max_target_length=32",
             "moe_mlp_dim=32", "routed_scaling_factor=2.5"]
# Qwen3-30B-A3B's layer whole on one GPU (no expert parallelism): the
# qwen3-moe-proxy preset's MoE (T = 4 x 4096 tokens, D = 2048, F = 768, all
# 128 experts top-8, no shared expert, softmax routing renormalised over the
# top 8).
QWEN3_BASE = ["model_name=qwen3-moe-proxy", "per_device_batch_size=4", "max_target_length=4096"]
BASES = {"deepseek3": BASE, "qwen3-30b": QWEN3_BASE, "tiny": TINY_BASE}
CASES = {
    "ours": {"gmm_backend": "auto"},
    "xla": {"gmm_backend": "xla"},
    "capacity-1.0": {"sparse_matmul": False, "capacity_factor": 1.0},
    "capacity-1.25": {"sparse_matmul": False, "capacity_factor": 1.25},
}
# torch baselines: case -> TorchMoE layout (torch_moe_layer.py); the ratio column is
# against the first.
TORCH_CASES = {"torch_grouped_mm": "fused", "torchtitan_ref": "torchtitan"}
TORCH_REF = "torch_grouped_mm"


def overrides_of(base: str, **case) -> list[str]:
    """The key=value list of a case on ``BASES[base]`` (``dropless train`` takes the same)."""
    return BASES[base] + [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                          for k, v in case.items()]


def resolve(base: str, **case):
    """The validated ``Config`` of a case. Raises ConfigError on a bad override."""
    from dropless.config.loader import load_config

    return load_config(None, overrides_of(base, **case), environ={}).config


def shape_of(cfg) -> dict:
    return {"batch": int(cfg.per_device_batch_size), "seq": cfg.max_target_length,
            "emb_dim": cfg.emb_dim, "moe_mlp_dim": cfg.moe_mlp_dim, "num_experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok, "shared_experts": cfg.shared_experts}


SHAPES = {name: shape_of(resolve(name)) for name in BASES}
FULL, TINY, QWEN3_30B = SHAPES["deepseek3"], SHAPES["tiny"], SHAPES["qwen3-30b"]


# shape field -> the config key it comes from (shape_of), for derived shapes
SHAPE_KEYS = {"batch": "per_device_batch_size", "seq": "max_target_length",
              "emb_dim": "emb_dim", "moe_mlp_dim": "moe_mlp_dim", "num_experts": "num_experts",
              "top_k": "num_experts_per_tok", "shared_experts": "shared_experts"}


def base_of(shape: dict) -> str:
    """The ``BASES`` key whose preset gives ``shape``: one of the ``SHAPES`` dicts, or
    a shape derived from one (other expert counts or sizes; ``ep_overhead.py``) that
    keeps its token and model dims.

    Raises:
      ValueError: no preset has ``shape``'s batch, seq and emb_dim.
    """
    for name, known in SHAPES.items():
        if shape is known:
            return name
    for name, known in SHAPES.items():
        if all(shape[k] == known[k] for k in ("batch", "seq", "emb_dim")):
            return name
    raise ValueError(f"shape {shape} has the batch, seq and emb_dim of none of the presets' "
                     f"{list(SHAPES)}")


def shape_overrides(shape: dict) -> dict:
    """The config keys by which ``shape`` differs from its preset's shape."""
    known = SHAPES[base_of(shape)]
    return {SHAPE_KEYS[k]: v for k, v in shape.items() if k in SHAPE_KEYS and known[k] != v}


# fwd_bwd_ms: within 15% of the expert GEMMs' physical time (24.7 ms at 790 TF/s); it
# was 36 ms before the bf16 work of issue 15 (34.4 ms measured then).
TARGETS = {"fwd_bwd_ms": 28.5, "routing_share_pct": 15.0, "torchtitan_fwd_bwd_ms": 43.6,
           "torchtitan_tflops": 447.0, "torchtitan_gemm_ms": 31.7}
ROUTING_PIECES = ("router", "permute", "combine")


def moe_config(shape: dict, **overrides) -> MoEConfig:
    """The MoE section of the preset that gives ``shape`` (``base_of``), with the keys
    ``shape`` changes and a case's ``overrides``.

    Raises:
      ValueError: ``shape`` comes from none of ``SHAPES``.
    """
    return resolve(base_of(shape), **{**shape_overrides(shape), **overrides}).moe()


def expert_flops(shape: dict) -> dict:
    """Useful expert FLOPs: fwd = 6*T*(K+S)*D*F, fwd+bwd = 3*fwd (see the module docstring)."""
    t = shape["batch"] * shape["seq"]
    experts = shape["top_k"] + shape["shared_experts"]
    fwd = 6 * t * experts * shape["emb_dim"] * shape["moe_mlp_dim"]
    return {"fwd": float(fwd), "fwd_bwd": 3.0 * fwd}


class Layer:
    """A bf16 ``MoEBlock`` at ``shape``, its states split for ``jax.vjp``, and random inputs.

    Param groups: ``router``, ``shared`` (shared experts), ``experts`` (wi, wo);
    ``rest`` holds the RouterBias. ``fwd(params, rest, x) -> (y, dropped)`` and
    ``fwd_bwd(params, rest, x, g) -> (y, grads)`` are jitted.
    """

    def __init__(self, shape: dict, cfg: MoEConfig, seed: int = 0):
        self.shape, self.cfg = shape, cfg
        b, s, d = shape["batch"], shape["seq"], shape["emb_dim"]
        block = moe.MoEBlock(cfg, emb_dim=d, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(seed))
        router = nnx.All(nnx.Param, nnx.PathContains("router"))
        shared = nnx.All(nnx.Param, nnx.PathContains("shared_experts"))
        self.graphdef, r, sh, ex, self.rest = nnx.split(block, router, shared, nnx.Param, ...)
        self.params = {"router": r, "shared": sh, "experts": ex}
        kx, kg = jax.random.split(jax.random.key(seed + 1))
        self.x = jax.random.normal(kx, (b, s, d), jnp.bfloat16)
        self.g = jax.random.normal(kg, (b, s, d), jnp.bfloat16)
        self.fwd = jax.jit(self._fwd)
        self.fwd_bwd = jax.jit(self._fwd_bwd)

    def block(self, params, rest):
        return nnx.merge(self.graphdef, params["router"], params["shared"], params["experts"], rest)

    def _fwd(self, params, rest, x):
        y, stats = self.block(params, rest)(x)
        return y, stats.dropped_tokens

    def _fwd_bwd(self, params, rest, x, g):
        def f(params, x):
            y, stats = self.block(params, rest)(x)
            return y, stats.aux_loss

        (y, aux), pullback = jax.vjp(f, params, x)
        return y, pullback((g, jnp.ones_like(aux)))


def _pair(fn, diff, nondiff, cot, has_aux=False):
    """(jitted fwd, its args), (jitted fwd+bwd via jax.vjp, its args) of ``fn(*diff, *nondiff)``."""
    fwd = jax.jit(lambda diff, nondiff: fn(*diff, *nondiff))

    def fwd_bwd(diff, nondiff, cot):
        res = jax.vjp(lambda *d: fn(*d, *nondiff), *diff, has_aux=has_aux)
        return res[0], res[-1] if has_aux else None, res[1](cot)

    return (fwd, (diff, nondiff)), (jax.jit(fwd_bwd), (diff, nondiff, cot))


def split_pieces(layer: Layer) -> dict:
    """The sparse path's pieces: name -> ((fwd, args), (fwd_bwd, args)), on real intermediates.

    Raises:
      ValueError: the layer is on the capacity path (no pieces to split).
    """
    if not layer.cfg.sparse_matmul:
        raise ValueError("the time split covers the dropless (sparse_matmul) path only")
    b, s, d = layer.x.shape
    p, rest = layer.params, layer.rest
    x_TD = layer.x.reshape(b * s, d)
    e, align = layer.cfg.num_experts, layer.cfg.group_alignment
    key = iter(jax.random.split(jax.random.key(7), 8))

    def router(router_p, x_TD):
        block = layer.block({**p, "router": router_p}, rest)
        logits_TE, decision = block._route(x_TD)
        aux = block._aux_loss(logits_TE, decision, b, s)
        return (decision.weights_TK, aux), decision.experts_TK

    (weights_TK, _), experts_TK = jax.jit(router)(p["router"], x_TD)
    x_PD, plan = jax.jit(lambda x, ex: moe.dispatch(x, ex, e, align))(x_TD, experts_TK)
    def experts(ep, x, gs):
        return layer.block({**p, "experts": ep}, rest)._experts_sparse(x, gs)

    y_PD = jax.jit(experts)(p["experts"], x_PD, plan.group_sizes_E)

    def rand(like):
        return jax.random.normal(next(key), like.shape, jnp.float32).astype(like.dtype)

    pieces = {
        "router": _pair(router, (p["router"], x_TD), (), (rand(weights_TK), jnp.ones(())),
                        has_aux=True),
        "permute": _pair(lambda x, ex: moe.dispatch(x, ex, e, align), (x_TD,), (experts_TK,),
                         rand(x_PD), has_aux=True),
        "gmm": _pair(experts, (p["experts"], x_PD), (plan.group_sizes_E,), rand(y_PD)),
        "combine": _pair(lambda y, w, plan: moe.combine(y, w, plan), (y_PD, weights_TK), (plan,),
                         rand(x_TD)),
    }
    if layer.cfg.shared_experts:  # Qwen3-MoE has none
        pieces["shared"] = _pair(lambda sp, x: layer.block({**p, "shared": sp}, rest).shared_experts(x),
                                 (p["shared"], x_TD), (), rand(x_TD))
    return pieces


def compose_forward(layer: Layer, pieces: dict):
    """The layer's output [B, S, D] rebuilt from the pieces' forward functions (for tests)."""
    b, s, d = layer.x.shape
    (router_fwd, (router_args, _)) = pieces["router"][0]
    (weights_TK, _), experts_TK = router_fwd(router_args, ())
    x_TD = layer.x.reshape(b * s, d)
    x_PD, plan = pieces["permute"][0][0]((x_TD,), (experts_TK,))
    gmm_fwd, (gmm_diff, _) = pieces["gmm"][0]
    y_PD = gmm_fwd((gmm_diff[0], x_PD), (plan.group_sizes_E,))
    out_TD = pieces["combine"][0][0]((y_PD, weights_TK), (plan,))
    if "shared" in pieces:
        shared_fwd, (shared_args, _) = pieces["shared"][0]
        out_TD = out_TD + shared_fwd(shared_args, ())
    return out_TD.reshape(b, s, d)


def _timing(fn, args, quick: bool) -> float:
    """Median milliseconds of ``fn(*args)``."""
    return measure.time_fn(fn, *args, warmup=2, iters=5 if quick else 10)["median_ms"]


def _tflops(flops: float, ms: float | None):
    return flops / (ms * 1e-3) / 1e12 if ms else None


def _error(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:300]}"


def case_backend(cfg: MoEConfig, shape: dict) -> str:
    """The grouped-GEMM backend a case runs on (``dense_matmul`` on the capacity path)."""
    if not cfg.sparse_matmul:
        return "dense_matmul"
    t, d = shape["batch"] * shape["seq"], shape["emb_dim"]
    return resolve_backend(cfg.gmm_backend, (t * shape["top_k"], d),
                           (shape["num_experts"], d, 2 * shape["moe_mlp_dim"]), jnp.bfloat16)


def ragged_dot_fwd_bwd_bytes(shape: dict, cfg: MoEConfig) -> int:
    """A lower bound on the device bytes of the layer's fwd+bwd when its expert GEMMs are
    ``lax.ragged_dot`` (``gmm_backend=xla``), bf16.

    XLA (jaxlib 0.11.2) lowers a ragged dot of x [P, K] (rows grouped by expert) with
    w [G, K, N] to a masked dense product over the groups: it writes x_GPK, x masked to
    each group's rows, and contracts it with w over G and K. The weight gradient
    (``ops.gmm.xla.tgmm``, ragged along the contracted P) expands both of its operands,
    x_GPK and the output gradient dy_GPN, and contracts them over P in one batched dot
    into dw_GKN; the operands and the result of one instruction are live together, so
    that dot alone holds 2*G*P*(K + N) + 2*G*K*N bytes. The forward and the data
    gradient expand one operand each, so the weight gradients bound the layer: the
    larger of gate|up (K = D, N = 2F, or F per projection when gate and up are separate)
    and down (K = F, N = D). P is the dispatch buffer's rows (T*K plus the alignment's
    padding). Qwen3-30B (G = 128, P = 131072, D = 2048, 2F = 1536) gives 121,064,390,656
    bytes, exactly the size XLA's scheduler printed for that dot's arguments on the H200
    (``results/logs/moe-layer-qwen3-oom-20261202-1643-h200.log``). Everything else the
    program holds comes on top: at the DeepSeek shape XLA's whole fwd+bwd asked for
    88.2 GiB against this bound's 45.8 GiB (``results/moe_layer-20261202-074024-*``).
    """
    g, d, f = shape["num_experts"], shape["emb_dim"], shape["moe_mlp_dim"]
    p = permute_ops.buffer_rows(shape["batch"] * shape["seq"] * shape["top_k"], g,
                                moe.group_alignment(cfg))
    gate_up_n = 2 * f if cfg.prefuse_moe_weights else f
    return max(2 * g * p * (k + n) + 2 * g * k * n for k, n in ((d, gate_up_n), (f, d)))


def device_bytes_limit() -> int | None:
    """Bytes JAX's allocator may take on the first device (None where it reports none: CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def skip_row(name: str, shape: dict, device_bytes: int | None) -> dict | None:
    """The record's row for a case that cannot fit in ``device_bytes``, or None to run it.

    Only the ``lax.ragged_dot`` path has a bound (``ragged_dot_fwd_bwd_bytes``): there
    XLA's GPU autotuner allocates the dense operands while compiling, and at the
    Qwen3-30B shape it spent the run's whole time limit failing to. The other paths
    have no bound here: they are compiled and run, and an out-of-memory is recorded as
    their error (a CPU compile of the capacity baseline's fwd+bwd at the Qwen3-30B
    shape reports 28 GiB of temporaries).
    """
    cfg = moe_config(shape, **CASES[name])
    backend = case_backend(cfg, shape)
    if backend != "xla" or device_bytes is None:
        return None
    need = ragged_dot_fwd_bwd_bytes(shape, cfg)
    if need <= device_bytes:
        return None
    return {"case": name, "backend": backend,
            "overrides": overrides_of(base_of(shape), **shape_overrides(shape), **CASES[name]),
            "skipped": f"fwd+bwd needs >= {need / 2**30:.1f} GiB (ragged_dot's dense operands), "
                       f"device allows {device_bytes / 2**30:.1f} GiB",
            "estimate_bytes": need, "device_bytes": device_bytes,
            "estimate": "ragged_dot_fwd_bwd_bytes: the weight gradient's masked dense operands "
                        "and result, 2*G*P*(K+N) + 2*G*K*N"}


def time_case(name: str, shape: dict, quick: bool) -> tuple[dict, Layer]:
    """Fwd and fwd+bwd times of one case; returns (row, layer)."""
    layer = Layer(shape, moe_config(shape, **CASES[name]))
    t = shape["batch"] * shape["seq"]
    row = {"case": name, "overrides": overrides_of(base_of(shape), **shape_overrides(shape), **CASES[name]),
           "backend": case_backend(layer.cfg, shape),
           "sparse_matmul": layer.cfg.sparse_matmul, "capacity_factor":
           None if layer.cfg.sparse_matmul else layer.cfg.capacity_factor}
    flops = expert_flops(shape)
    args = (layer.params, layer.rest, layer.x)
    dropped = int(layer.fwd(*args)[1])
    row["dropped_fraction"] = dropped / (t * shape["top_k"])
    for key, fn, fn_args in (("fwd", layer.fwd, args),
                             ("fwd_bwd", layer.fwd_bwd, (*args, layer.g))):
        try:
            row[f"{key}_ms"] = _timing(fn, fn_args, quick)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, go on
            row[f"{key}_ms"], row[f"{key}_error"] = None, _error(e)
        row[f"{key}_tflops"] = _tflops(flops[key], row[f"{key}_ms"])
    return row, layer


def _torch_module():
    """``torch_moe_layer.py`` beside this file, loaded on first use (it imports torch).

    Raises:
      RuntimeError: torch is not installed, or has no ``torch._grouped_mm``.
    """
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("the torch cases need torch, which is not installed here")
    spec = importlib.util.spec_from_file_location("torch_moe_layer",
                                                  Path(__file__).with_name("torch_moe_layer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module.torch, "_grouped_mm"):
        raise RuntimeError(f"torch {module.torch.__version__} has no torch._grouped_mm")
    return module


def time_torch_case(name: str, shape: dict, quick: bool) -> dict:
    """Fwd and fwd+bwd times of a torch case (``TORCH_CASES``) on the config of ``ours``.

    Raises:
      RuntimeError: torch is missing (``_torch_module``).
    """
    cfg = moe_config(shape)
    row = {"case": name, "overrides": overrides_of(base_of(shape), **shape_overrides(shape)),
           "backend": f"torch._grouped_mm ({TORCH_CASES[name]})", "sparse_matmul": True,
           "capacity_factor": None, "dropped_fraction": 0.0}
    row.update(_torch_module().run_case(cfg, shape, TORCH_CASES[name], quick))
    flops = expert_flops(shape)
    for key in ("fwd", "fwd_bwd"):
        row[f"{key}_tflops"] = _tflops(flops[key], row[f"{key}_ms"])
    return row


def torch_speedups(rows: list[dict]) -> dict:
    """case -> {"fwd", "fwd_bwd"}: ``TORCH_REF``'s time over the case's (> 1: faster than torch),
    for every non-torch row not failed or skipped; {} when the torch reference has no time."""
    ref = next((r for r in rows if r["case"] == TORCH_REF and "error" not in r), None)
    if ref is None:
        return {}
    return {r["case"]: {k: ref[f"{k}_ms"] / r[f"{k}_ms"] if ref.get(f"{k}_ms") and r.get(f"{k}_ms")
                        else None for k in ("fwd", "fwd_bwd")}
            for r in rows if not {"error", "skipped"} & set(r) and r["case"] not in TORCH_CASES}


def time_split(layer: Layer, layer_row: dict, quick: bool) -> dict:
    """Per-piece fwd and fwd+bwd times of the dropless layer and the routing share."""
    pieces = split_pieces(layer)
    rows = []
    for piece, ((fwd, fwd_args), (fwd_bwd, fb_args)) in pieces.items():
        rows.append({"piece": piece, "fwd_ms": _timing(fwd, fwd_args, quick),
                     "fwd_bwd_ms": _timing(fwd_bwd, fb_args, quick)})
    out = {"case": layer_row["case"], "backend": layer_row["backend"], "pieces": rows}
    for key in ("fwd", "fwd_bwd"):
        total = layer_row.get(f"{key}_ms")
        routing = sum(r[f"{key}_ms"] for r in rows if r["piece"] in ROUTING_PIECES)
        out[f"sum_{key}_ms"] = sum(r[f"{key}_ms"] for r in rows)
        out[f"layer_{key}_ms"] = total
        out[f"routing_{key}_ms"] = routing
        # Share of the measured layer time (the target), not of the sum of pieces.
        out[f"routing_share_{key}_pct"] = 100 * routing / total if total else None
    return out


def trace_breakdown(layer: Layer) -> dict:
    """Kernel categories of the whole layer's fwd+bwd, from a profiler trace of 3 calls."""
    bd = measure.profile_calls(layer.fwd_bwd, layer.params, layer.rest, layer.x, layer.g, calls=3)
    keep = ("platform", "steps", "wall_us", "kernel_us", "busy_pct", "categories", "top_kernels",
            "notes")
    return {k: v for k, v in bd.to_dict().items() if k in keep}


_HLO_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)"
                        r"\[([0-9,]*)\]")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
              "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def large_copies(hlo: str, min_bytes: int = 64 << 20) -> list[dict]:
    """The ``copy`` and ``copy-start`` instructions of an optimized HLO text whose result
    holds at least ``min_bytes``: {"name", "op", "shape", "mib"}, largest first. (On the
    H200, ours' fwd+bwd showed 13 device-to-device memcpys per call, 0.83 ms each,
    beside the kernels; these are what XLA can lower to such copies.)"""
    found = []
    for inst in hlo_lib.instructions(hlo):
        array = _HLO_ARRAY.search(inst.type) if inst.opcode in ("copy", "copy-start") else None
        if not array:
            continue
        dtype, dims = array.groups()
        size = _HLO_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        if size >= min_bytes:
            found.append({"name": inst.name, "op": inst.opcode,
                          "shape": f"{dtype}[{dims}]", "mib": round(size / 2**20, 1)})
    return sorted(found, key=lambda c: -c["mib"])


def dump_hlo(layer: Layer, path: Path) -> dict:
    """Write the optimized HLO of the layer's jitted fwd+bwd to ``path`` (gzip text) and
    return its large copies (``large_copies``)."""
    text = layer.fwd_bwd.lower(layer.params, layer.rest, layer.x, layer.g).compile().as_text()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write(text)
    return {"path": str(path), "large_copies": large_copies(text)}


def run(quick: bool = False, out_dir=measure.DEFAULT_RESULTS_DIR, tiny: bool = False,
        cases=None, trace: bool = True, shape_name: str = "deepseek3",
        dump_hlo_path=None, device_bytes: int | None = None) -> dict:
    """Run the benchmark, write its record to ``out_dir`` and return the record.

    Args:
      quick: fewer timing samples and only the torch / ours / xla / capacity-1.0 cases.
      tiny: the small CPU-friendly shape instead of ``shape_name``'s.
      shape_name: a key of ``SHAPES`` (deepseek3 | qwen3-30b).
      cases: names from ``TORCH_CASES`` and ``CASES`` (default: all, or the quick subset);
        the torch cases run first whatever the order given.
      trace: also profile ours' fwd+bwd and break its kernel time down.
      dump_hlo_path: also write ours' optimized fwd+bwd HLO there (``dump_hlo``), its large
        copies in the record's ``hlo``.
      device_bytes: the memory a case must fit in (``skip_row``); default: what JAX's
        allocator may take on this device (``device_bytes_limit``).
    """
    shape = TINY if tiny else SHAPES[shape_name]
    names = list(cases or [*TORCH_CASES, *(["ours", "xla", "capacity-1.0"] if quick else CASES)])
    unknown = set(names) - set(CASES) - set(TORCH_CASES)
    if unknown:
        raise ValueError(f"unknown cases {sorted(unknown)}; choose from "
                         f"{[*TORCH_CASES, *CASES]}")
    # torch first: it gives its memory back, while jax's allocator keeps what it grew.
    names.sort(key=lambda n: n not in TORCH_CASES)
    record = measure.new_record("moe_layer", {**shape, "tokens": shape["batch"] * shape["seq"],
                                              "dtype": "bfloat16", "tiny": tiny, "quick": quick,
                                              "shape": "tiny" if tiny else shape_name,
                                              "moe": vars(moe_config(shape)),
                                              "base_overrides": BASES[base_of(shape)]})
    record.update(flops=expert_flops(shape), targets=TARGETS, split=None, kernel_breakdown=None,
                  flops_formula="fwd = 6*T*(K+S)*D*F (K routed + S shared SwiGLU experts); "
                                "fwd+bwd = 3*fwd; router excluded")
    device_bytes = device_bytes or device_bytes_limit()
    for name in names:
        if name in TORCH_CASES:
            try:
                record["rows"].append(time_torch_case(name, shape, quick))
            except Exception as e:  # noqa: BLE001 - no torch, out of memory: record it, go on
                record["rows"].append({"case": name, "error": _error(e)})
            continue
        skipped = skip_row(name, shape, device_bytes)
        if skipped:
            print(f"skipping {name}: {skipped['skipped']}", flush=True)
            record["rows"].append(skipped)
            continue
        try:
            row, layer = time_case(name, shape, quick)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            record["rows"].append({"case": name, "error": _error(e)})
            continue
        record["rows"].append(row)
        if name == "ours":
            if dump_hlo_path:
                record["hlo"] = _guarded(dump_hlo, layer, dump_hlo_path)
            record["split"] = _guarded(time_split, layer, row, quick)
            if trace and row.get("fwd_bwd_ms"):
                record["kernel_breakdown"] = _guarded(trace_breakdown, layer)
        del layer
        gc.collect()
    record["torch_speedup"] = torch_speedups(record["rows"])
    record["path"] = str(measure.write_record(record, out_dir))
    return record


def _guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - keep the layer timings if a side measurement fails
        return {"error": _error(e)}


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def print_tables(record: dict, console=None) -> None:
    """The split and kernel tables, then the main case table (last)."""
    from rich.console import Console
    from rich.table import Table

    console = console or (Console() if sys.stdout.isatty() else Console(width=140))
    split = record.get("split") or {}
    if split.get("pieces"):
        table = Table(title=f"MoE layer time split ({split['case']}, {split['backend']})")
        for col in ("piece", "fwd ms", "fwd+bwd ms", "% of layer fwd+bwd"):
            table.add_column(col, justify="left" if col == "piece" else "right")
        total = split.get("layer_fwd_bwd_ms")
        for r in split["pieces"]:
            share = 100 * r["fwd_bwd_ms"] / total if total else None
            table.add_row(r["piece"], _fmt(r["fwd_ms"], ".3f"), _fmt(r["fwd_bwd_ms"], ".3f"),
                          _fmt(share, ".1f"))
        table.add_row("sum of pieces", _fmt(split["sum_fwd_ms"], ".3f"),
                      _fmt(split["sum_fwd_bwd_ms"], ".3f"), "", style="bold")
        routing = _fmt(split["routing_share_fwd_bwd_pct"], ".1f")
        table.caption = (f"router+permute+combine = {routing}% of the layer's fwd+bwd "
                         f"(target < {TARGETS['routing_share_pct']:.0f}%)")
        console.print(table)
    elif split.get("error"):
        console.print(f"[yellow]time split failed:[/] {split['error']}")
    bd = record.get("kernel_breakdown") or {}
    if bd.get("categories"):
        line = ", ".join(f"{c['label']} {c['pct_kernel']:.1f}%" for c in bd["categories"]
                         if c["pct_kernel"] > 0)
        console.print(f"ours fwd+bwd kernel time by category: {line}")
    cfg = record["config"]
    table = Table(title=(f"MoE layer, T={cfg['tokens']} D={cfg['emb_dim']} F={cfg['moe_mlp_dim']} "
                         f"E={cfg['num_experts']} K={cfg['top_k']} S={cfg['shared_experts']} bf16 "
                         f"on {record['device']['gpu']}"))
    speedups = record.get("torch_speedup") or {}
    for col in ("case", "backend", "fwd ms", "fwd TF/s", "fwd+bwd ms", "fwd+bwd TF/s",
                "dropped", "vs torchtitan", f"vs {TORCH_REF}"):
        table.add_column(col, justify="left" if col in ("case", "backend") else "right")
    for r in record["rows"]:
        if "error" in r:
            table.add_row(r["case"], f"[red]{r['error'][:60]}[/]", *[""] * 7)
            continue
        if "skipped" in r:
            table.add_row(r["case"], f"[yellow]skipped: {r['skipped']}[/]", *[""] * 7)
            continue
        ms = r.get("fwd_bwd_ms")
        table.add_row(r["case"], r["backend"], _fmt(r.get("fwd_ms")),
                      _fmt(r.get("fwd_tflops"), ".0f"),
                      _fmt(ms) if ms else f"[red]{r.get('fwd_bwd_error', '-')[:40]}[/]",
                      _fmt(r.get("fwd_bwd_tflops"), ".0f"), f"{100 * r['dropped_fraction']:.1f}%",
                      # torchtitan's time is for the full shape only.
                      "-" if cfg["tiny"] or cfg.get("shape", "deepseek3") != "deepseek3" or not ms
                      else f"{TARGETS['torchtitan_fwd_bwd_ms'] / ms:.2f}x",
                      _fmt(speedups.get(r["case"], {}).get("fwd_bwd"), ".2f"))
    table.caption = (f"TF/s count expert FLOPs ({record['flops_formula']}). Target: fwd+bwd < "
                     f"{TARGETS['fwd_bwd_ms']:g} ms; torchtitan "
                     f"{TARGETS['torchtitan_fwd_bwd_ms']} ms "
                     f"({TARGETS['torchtitan_tflops']:.0f} TF/s), its bare grouped GEMMs "
                     f"{TARGETS['torchtitan_gemm_ms']} ms (an earlier run). vs {TORCH_REF}: its "
                     f"fwd+bwd time over the case's, this run")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and cases")
    parser.add_argument("--tiny", action="store_true", help="small shape (CPU smoke run)")
    parser.add_argument("--shape", default="deepseek3", choices=list(SHAPES),
                        help="layer shape: deepseek3 (V3 with 8-way EP, the default) or qwen3-30b")
    parser.add_argument("--out", type=Path, default=measure.DEFAULT_RESULTS_DIR,
                        help="results directory (default benchmarks/results)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated subset of {','.join([*TORCH_CASES, *CASES])}")
    parser.add_argument("--no-trace", action="store_true", help="skip the profiler breakdown")
    parser.add_argument("--dump-hlo", type=Path, default=None, metavar="F.gz",
                        help="write ours' optimized fwd+bwd HLO there and list its large copies")
    args = parser.parse_args(argv)
    record = run(quick=args.quick, out_dir=args.out, tiny=args.tiny,
                 cases=args.cases.split(",") if args.cases else None, trace=not args.no_trace,
                 shape_name=args.shape, dump_hlo_path=args.dump_hlo)
    for c in (record.get("hlo") or {}).get("large_copies") or []:
        print(f"HLO {c['op']} {c['name']}: {c['shape']} ({c['mib']} MiB)")
    print_tables(record)
    print(f"wrote {record['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
