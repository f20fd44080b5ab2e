"""Do FP8 dense layers pay? Each dense matmul of the proxy in bf16 and in FP8 (current scaling).

    PYTHONPATH=src python3 benchmarks/fp8_dense.py [--iters 10] [--out DIR] [key=value ...]   # GPU
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/fp8_dense.py --tiny                 # CPU smoke

Legend: T tokens per device (``per_device_batch_size x max_target_length``),
K the matmul's input width, N its output width; every matmul is
``x [B, S, K] . w [K, N]``, as ``nnx.Linear`` computes it in the model.

The matmuls and their shapes come from the resolved ``deepseek3-proxy`` config
(``--tiny``: ``deepseek3-tiny`` in bfloat16), through the loader ``dropless
train`` uses, plus any ``key=value`` overrides on the command line:

  attention   MLA ``wq_a`` [D, Lq], ``wq_b`` [Lq, H*Q] (or ``wq`` [D, H*Q] when
              Lq = 0), ``wkv_a`` [D, Lkv+R], ``wkv_b`` [Lkv, H*(N+V)], ``wo`` [H*V, D];
              GQA ``wq``, ``wk``, ``wv``, ``wo``. In every decoder layer and MTP module.
  dense MLP   ``wi_0``, ``wi_1`` [D, F], ``wo`` [F, D], in the first
              ``first_num_dense_layers`` layers (and MTP modules when no layer is MoE).
  shared      the shared experts' MLP at width ``shared_experts x moe_mlp_dim``, in
              every MoE layer and MTP module.
  head        ``head`` [D, vocab], once per step plus once per MTP module.

Each matmul runs through the ``dot_general`` the model picks
(``nn.model.dense_dot_general``): ``lax.dot_general`` for ``quantization=''``
and ``ops.fp8_dot.fp8_dot_general`` (E4M3 forward, E5M2 gradients, per-tensor
current scaling, the amax and casts timed with the products) for
``quantization=te_fp8_currentscaling``, inside the same ``nnx.Linear``. Timed:
the forward, and forward + backward (``jax.vjp``: the output and the
gradients wrt x and w, random bf16 cotangent), jitted, on random data:
wall-clock medians after warm-up (``perf.measure.time_fn``), and on the GPU
the summed kernel time (CUPTI, ``mosaic.gpu.profiler.measure``), which the
table uses when present. Matmuls of one shape are timed once.

Per step: ``count`` is how many times the matmul runs per training step;
per-step ms = count x fwd+bwd ms (activation recomputation under remat is not
counted), and share = its part of all dense matmul time. The FP8 total is
given twice: as ``quantization=te_fp8_currentscaling`` runs it with the
overrides given (the head in FP8 only with ``quantize_output_head``, matmuls
with K or N below ``fp8_min_dim`` in bf16) and with every matmul in FP8.

Checks recorded per row: the optimized HLO of each FP8 fwd+bwd holds E4M3
and E5M2 values (``f8e4m3``, ``f8e5m2``) and how many of its dots/GEMMs take FP8
operands (``f8_dots`` of ``dots``): a dot is an HLO ``dot`` or a custom-call
to a cuBLAS/cuBLASLt GEMM (by ``custom_call_target``), FP8 when its two matrix
operands have f8 types, read from the operands' defining instructions (the
GPU's HLO names a custom-call's operands without their types). 3 of 3 on the
GPU, where cuBLASLt runs FP8 x FP8; 0 of 3 on XLA:CPU, which converts the
codes to f32 before its dot. So a silent bf16 fallback shows. ``hlo_check``
is the parser's version: records without it (version 1) counted 0 FP8 dots on
the GPU whatever ran, as that parser read only inline operand types. Also the
FP8 output's and gradients' relative error against bf16 (zero would mean no
FP8 rounding happened), and ``f8_dot_out``: the output dtypes of the FP8
dots/GEMMs, counted (``{"f32": 3}`` on the GPU, where a separate fusion
converts to bf16).

The FP8 variant follows the config's ``fp8_dot_bf16_output`` (power-of-two scales,
the GEMMs writing bf16; ``ops.fp8_dot``). ``--compare-bf16-output`` also times the
FP8 form with the other setting, in the same process, as the variant
``fp8_other_output`` (its ``f8_dot_out`` says which: ``{"bf16": 3}`` for bf16 GEMM
outputs), and records per row ``other_output_speedup_fwd_bwd`` (``fp8`` time over
its time) and the per-step totals of both forms.

Writes ``<out>/fp8_dense-<time>-<gpu>.json`` (kind ``fp8_dense``) and prints the table.
"""

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dropless.nn.model import dense_dot_general
from dropless.ops.fp8_dot import stays_plain
from dropless.perf import hlo as hlo_lib
from dropless.perf import measure

BASE = ["model_name=deepseek3-proxy"]
# The tiny preset in the proxy's dtypes, so the CPU run exercises the same bf16 path.
TINY_BASE = ["model_name=deepseek3-tiny", "dtype=bfloat16", "weight_dtype=bfloat16"]
FP8 = "te_fp8_currentscaling"
DIMS = (((2,), (0,)), ((), ()))  # nnx.Linear on [B, S, K] . [K, N]


def resolve(overrides: list[str]):
    """The validated ``Config``. Raises ConfigError on a bad override."""
    from dropless.config.loader import load_config

    return load_config(None, overrides, environ={}).config


def matmuls(cfg) -> list[dict]:
    """The model's dense matmuls: [{"name", "group", "K", "N", "count", "fp8_in_model"}].

    ``count`` is the number of calls per training step (forward), ``fp8_in_model``
    whether ``quantization=te_fp8_currentscaling`` computes it in FP8 (the head
    only with ``quantize_output_head``; none with K or N below ``fp8_min_dim``).
    """
    d, n_dense = cfg.emb_dim, cfg.first_num_dense_layers
    n_moe = cfg.num_decoder_layers - n_dense
    mtp = cfg.mtp_num_layers
    attn_count = cfg.num_decoder_layers + mtp
    rows = []

    def add(group, name, k, n, count, fp8=True):
        if count > 0:  # fp8_min_dim keeps the narrower products in bf16 (fp8_dot_general)
            rows.append({"name": f"{group}.{name}", "group": group, "K": k, "N": n, "count": count,
                         "fp8_in_model": fp8 and not stays_plain(k, n, cfg.fp8_min_dim)})

    if cfg.attention_type == "mla":
        m = cfg.mla()
        h, q = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank > 0:
            add("mla", "wq_a", d, m.q_lora_rank, attn_count)
            add("mla", "wq_b", m.q_lora_rank, h * q, attn_count)
        else:
            add("mla", "wq", d, h * q, attn_count)
        add("mla", "wkv_a", d, m.kv_lora_rank + m.qk_rope_head_dim, attn_count)
        add("mla", "wkv_b", m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), attn_count)
        add("mla", "wo", h * m.v_head_dim, d, attn_count)
    else:
        g = cfg.gqa()
        h, kv, hd = g.num_heads, g.num_kv_heads, g.head_dim
        for name, n in (("wq", h * hd), ("wk", kv * hd), ("wv", kv * hd)):
            add("gqa", name, d, n, attn_count)
        add("gqa", "wo", h * hd, d, attn_count)
    dense_count = n_dense + (mtp if n_moe == 0 else 0)
    shared_count = (n_moe + mtp) if n_moe > 0 else 0
    for group, width, count in (("mlp", cfg.mlp_dim, dense_count),
                                ("shared", cfg.shared_experts * cfg.moe_mlp_dim,
                                 shared_count if cfg.shared_experts > 0 else 0)):
        add(group, "wi_0", d, width, count)
        add(group, "wi_1", d, width, count)
        add(group, "wo", width, d, count)
    add("head", "head", d, cfg.vocab_size, 1 + mtp, fp8=cfg.quantize_output_head)
    return rows


def linear_fns(k: int, n: int, quantization: str, dtype, param_dtype, bf16_output=False):
    """(fwd(w, x) -> y, fwd_bwd(w, x, dy) -> (y, dx, dw)) of the model's ``nnx.Linear``."""
    dot = dense_dot_general(quantization, bf16_output=bf16_output) or jax.lax.dot_general
    layer = nnx.Linear(k, n, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                       dot_general=dot, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(layer)

    def fwd(w, x):
        return nnx.merge(graphdef, nnx.State({"kernel": nnx.Param(w)}))(x)

    def fwd_bwd(w, x, dy):
        y, pullback = jax.vjp(lambda x, w: fwd(w, x), x, w)
        dx, dw = pullback(dy)
        return y, dx, dw

    return fwd, fwd_bwd


def inputs(b: int, s: int, k: int, n: int, dtype, param_dtype, seed: int = 0):
    """Random (w [K, N] fan-in scaled, x [B, S, K], dy [B, S, N]), as the model sees them."""
    kw, kx, kg = jax.random.split(jax.random.key(seed), 3)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(param_dtype)
    x = jax.random.normal(kx, (b, s, k), jnp.float32).astype(dtype)
    dy = jax.random.normal(kg, (b, s, n), jnp.float32).astype(dtype)
    return w, x, dy


HLO_CHECK = 2  # version of hlo_checks; 1 (absent) read operand types only where printed inline
GEMM_TARGETS = frozenset({"__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8",
                          "__cublas$lt$matmul$fp8"})


def hlo_checks(hlo: str) -> dict:
    """FP8 evidence in optimized HLO text: f8 types present, dots/GEMMs with f8 operands and
    their output dtypes (``f8_dot_out``: dtype -> count).

    A dot is an HLO ``dot`` or a ``custom-call`` whose target is a cuBLAS/cuBLASLt GEMM
    (``GEMM_TARGETS``); it counts as FP8 when its first two (matrix) operands have f8 types,
    read inline or from the operand's defining instruction in the same computation
    (``perf.hlo.Instruction.operand_types``).
    """
    dots = f8_dots = 0
    f8_out = {}
    for inst in hlo_lib.instructions(hlo):
        if inst.opcode != "dot" and inst.custom_call_target not in GEMM_TARGETS:
            continue
        dots += 1
        matrices = inst.operand_types[:2]
        if len(matrices) == 2 and all(t.startswith("f8e") for t in matrices):
            f8_dots += 1
            out = inst.result_types[0].split("[")[0]
            f8_out[out] = f8_out.get(out, 0) + 1
    return {"f8e4m3": "f8e4m3fn" in hlo, "f8e5m2": "f8e5m2" in hlo, "dots": dots,
            "f8_dots": f8_dots, "f8_dot_out": f8_out, "hlo_check": HLO_CHECK}


def cupti_ms(fn, args, iters):
    """Median summed kernel time of one call (ms), or None off the GPU / without CUPTI."""
    if jax.default_backend() != "gpu":
        return None
    try:
        return statistics.median(measure.cupti_kernel_ms(fn, *args, iters=iters))
    except Exception:  # noqa: BLE001 - no CUPTI: wall-clock only
        return None


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


OTHER = "fp8_other_output"  # --compare-bf16-output's variant


def variants(cfg, compare_bf16_output=False):
    """(name, quantization, bf16_output) of each timed variant: bf16, FP8 as the config
    says, and with ``compare_bf16_output`` FP8 with the other ``fp8_dot_bf16_output``."""
    out = [("bf16", "", False), ("fp8", FP8, cfg.fp8_dot_bf16_output)]
    if compare_bf16_output:
        out.append((OTHER, FP8, not cfg.fp8_dot_bf16_output))
    return out


def time_shape(b, s, k, n, cfg, iters, warmup, reps=None, compare_bf16_output=False):
    """bf16 and FP8 timings, HLO checks and FP8-vs-bf16 errors of one [B*S, K] x [K, N] shape."""
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    w, x, dy = inputs(b, s, k, n, dtype, param_dtype)
    out, results = {}, {}
    for variant, quant, bf16_output in variants(cfg, compare_bf16_output):
        fwd, fwd_bwd = linear_fns(k, n, quant, dtype, param_dtype, bf16_output)
        r = {}
        for key, fn, args in (("fwd", fwd, (w, x)), ("fwd_bwd", fwd_bwd, (w, x, dy))):
            compiled = jax.jit(fn).lower(*args).compile()
            if key == "fwd_bwd":
                r.update(hlo_checks(compiled.as_text()))
                results[variant] = jax.block_until_ready(compiled(*args))
            r[f"{key}_wall_ms"] = measure.time_fn(compiled, *args, warmup=warmup,
                                                  iters=iters, reps=reps)["median_ms"]
            r[f"{key}_kernel_ms"] = cupti_ms(jax.jit(fn), args, iters)
            r[f"{key}_ms"] = r[f"{key}_kernel_ms"] or r[f"{key}_wall_ms"]
        out[variant] = r
    for variant in out.keys() - {"bf16"}:
        for i, name in enumerate(("y", "dx", "dw")):
            out[variant][f"rel_err_{name}"] = rel_err(results[variant][i], results["bf16"][i])
            out[variant][f"finite_{name}"] = bool(np.all(np.isfinite(
                np.asarray(results[variant][i], np.float32))))
    return out


def run(tiny=False, overrides=(), iters=10, warmup=2, out_dir=measure.DEFAULT_RESULTS_DIR,
        reps=None, compare_bf16_output=False):
    """Time every dense matmul, write the record and return it.

    ``reps``: calls per timing sample (None: ``time_fn`` picks about 20 ms worth).
    The shapes, dtypes and what FP8 covers come from the config with
    ``quantization=te_fp8_currentscaling`` added after the overrides (so
    ``fp8_min_dim`` and ``quantize_output_head`` overrides validate).

    Raises:
      ConfigError: a bad override; ValueError: a fractional per_device_batch_size.
    """
    used = [*(TINY_BASE if tiny else BASE), *overrides]
    cfg = resolve([*used, f"quantization={FP8}"])
    b, s = cfg.per_device_batch_size, cfg.max_target_length
    if b != int(b):
        raise ValueError(f"per_device_batch_size={b} must be whole for this benchmark")
    b = int(b)
    t = b * s
    rows = matmuls(cfg)
    record = measure.new_record("fp8_dense", {
        "overrides": used, "tiny": tiny, "tokens": t, "batch": b, "seq": s,
        "dtype": cfg.dtype, "weight_dtype": cfg.weight_dtype, "iters": iters, "reps": reps,
        "quantize_output_head": cfg.quantize_output_head, "fp8_min_dim": cfg.fp8_min_dim, "fp8": FP8,
        "fp8_dot_bf16_output": cfg.fp8_dot_bf16_output, "compare_bf16_output": compare_bf16_output,
        "layers": {"decoder": cfg.num_decoder_layers, "dense": cfg.first_num_dense_layers,
                   "moe": cfg.num_decoder_layers - cfg.first_num_dense_layers,
                   "mtp": cfg.mtp_num_layers}})
    cache = {}
    for row in rows:
        k, n = row["K"], row["N"]
        if (k, n) not in cache:
            try:
                cache[(k, n)] = time_shape(b, s, k, n, cfg, iters, warmup, reps,
                                           compare_bf16_output)
            except Exception as e:  # noqa: BLE001 - one shape failing (memory) keeps the others
                cache[(k, n)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        res = cache[(k, n)]
        flops = 2.0 * t * k * n
        row.update(T=t, flops_fwd=flops, flops_fwd_bwd=3 * flops)
        if "error" in res:
            row["error"] = res["error"]
            record["rows"].append(row)
            continue
        # Copies: rows of one shape share the timings but not their per-step figures.
        row.update({v: dict(r) for v, r in res.items()})
        for v in res:
            r = row[v]
            r["fwd_tflops"] = flops / r["fwd_ms"] / 1e9
            r["fwd_bwd_tflops"] = 3 * flops / r["fwd_bwd_ms"] / 1e9
            r["step_ms"] = row["count"] * r["fwd_bwd_ms"]
        row["speedup_fwd"] = row["bf16"]["fwd_ms"] / row["fp8"]["fwd_ms"]
        row["speedup_fwd_bwd"] = row["bf16"]["fwd_bwd_ms"] / row["fp8"]["fwd_bwd_ms"]
        if OTHER in row:
            row["other_output_speedup_fwd_bwd"] = row["fp8"]["fwd_bwd_ms"] / row[OTHER]["fwd_bwd_ms"]
        record["rows"].append(row)
    record["totals"] = totals(record["rows"])
    record["path"] = str(measure.write_record(record, out_dir))
    return record


def totals(rows) -> dict:
    """Per-step dense matmul ms in bf16, in FP8 as configured and all FP8; shares per row."""
    ok = [r for r in rows if "error" not in r]
    bf16 = sum(r["bf16"]["step_ms"] for r in ok)
    # As configured, the matmuls the model keeps in bf16 (fp8_in_model false) count at their bf16 time.
    fp8_model = sum(r["fp8" if r["fp8_in_model"] else "bf16"]["step_ms"] for r in ok)
    fp8_all = sum(r["fp8"]["step_ms"] for r in ok)
    for r in ok:
        r["share_bf16_pct"] = 100 * r["bf16"]["step_ms"] / bf16 if bf16 else None
        r["share_fp8_pct"] = 100 * r["fp8"]["step_ms"] / fp8_all if fp8_all else None
    other = {}
    if ok and OTHER in ok[0]:
        other_model = sum(r[OTHER if r["fp8_in_model"] else "bf16"]["step_ms"] for r in ok)
        other = {"step_ms_other_output_as_configured": other_model,
                 "step_ms_other_output_all": sum(r[OTHER]["step_ms"] for r in ok),
                 "speedup_other_output_as_configured": bf16 / other_model if other_model else None}
    return {"step_ms_bf16": bf16, "step_ms_fp8_as_configured": fp8_model,
            "step_ms_fp8_all": fp8_all, **other,
            "speedup_as_configured": bf16 / fp8_model if fp8_model else None,
            "speedup_all": bf16 / fp8_all if fp8_all else None,
            "failed": [r["name"] for r in rows if "error" in r],
            "time_source": "kernel (CUPTI)" if ok and ok[0]["bf16"]["fwd_kernel_ms"] else "wall"}


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def print_table(record, console=None):
    from rich.console import Console
    from rich.table import Table

    c, tot = record["config"], record["totals"]
    console = console or (Console() if sys.stdout.isatty() else Console(width=170))
    table = Table(title=f"Dense matmuls, bf16 vs {FP8} (scaling included), T={c['tokens']}, "
                        f"{tot['time_source']} ms, on {record['device']['gpu']}")
    cols = ("matmul", "K x N", "count", "bf16 fwd+bwd ms", "TF/s", "fp8 fwd+bwd ms", "TF/s ",
            "speed-up", "fwd speed-up", "bf16 ms/step", "share", "fp8 ms/step", "f8 dots",
            "fp8 rel err y/dx/dw")
    for col in cols:
        table.add_column(col, justify="left" if col in ("matmul", "K x N") else "right")
    for r in record["rows"]:
        if "error" in r:
            table.add_row(r["name"], f"{r['K']} x {r['N']}", str(r["count"]),
                          f"[red]{r['error'][:80]}[/]", *[""] * (len(cols) - 4))
            continue
        b, f = r["bf16"], r["fp8"]
        name = r["name"] + ("" if r["fp8_in_model"] else " *")
        f8 = f"{f['f8_dots']}/{f['dots']}" + ("" if f["f8e4m3"] and f["f8e5m2"] else " [red]no f8[/]")
        table.add_row(name, f"{r['K']} x {r['N']}", str(r["count"]), _f(b["fwd_bwd_ms"], ".3f"),
                      _f(b["fwd_bwd_tflops"], ".0f"), _f(f["fwd_bwd_ms"], ".3f"),
                      _f(f["fwd_bwd_tflops"], ".0f"), _f(r["speedup_fwd_bwd"]) + "x",
                      _f(r["speedup_fwd"]) + "x", _f(b["step_ms"], ".2f"),
                      _f(r["share_bf16_pct"], ".1f") + "%", _f(f["step_ms"], ".2f"), f8,
                      "/".join(f"{f[f'rel_err_{v}']:.1e}" for v in ("y", "dx", "dw")))
    table.add_row("total per step", "", "", "", "", "", "", _f(tot["speedup_as_configured"]) + "x",
                  "", _f(tot["step_ms_bf16"]), "100%", _f(tot["step_ms_fp8_as_configured"]), "", "",
                  style="bold")
    table.caption = (f"* not FP8 in the model: the head unless quantize_output_head (now "
                     f"{c['quantize_output_head']}), K or N below fp8_min_dim (now "
                     f"{c.get('fp8_min_dim', 0)}); all matmuls in FP8: "
                     f"{_f(tot['step_ms_fp8_all'])} ms/step, {_f(tot['speedup_all'])}x. "
                     f"f8 dots: dots with FP8 operands / all dots in the fwd+bwd HLO; FP8 GEMM "
                     f"outputs {'bf16' if c.get('fp8_dot_bf16_output') else 'float32'} "
                     f"(fp8_dot_bf16_output={bool(c.get('fp8_dot_bf16_output'))}).")
    console.print(table)
    if "step_ms_other_output_as_configured" in tot:
        other = "float32" if c.get("fp8_dot_bf16_output") else "bf16"
        console.print(
            f"FP8 with {other} GEMM outputs ({OTHER}): {_f(tot['step_ms_other_output_as_configured'])} "
            f"ms/step as configured ({_f(tot['speedup_other_output_as_configured'])}x bf16), "
            f"{_f(tot['step_ms_other_output_all'])} all in FP8; per matmul, fp8 fwd+bwd time over "
            f"its: " + ", ".join(f"{r['name']} {r['other_output_speedup_fwd_bwd']:.2f}x"
                                 for r in record["rows"] if "other_output_speedup_fwd_bwd" in r))


def main(argv=None) -> int:
    from dropless.config.loader import ConfigError

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config key=value overrides")
    p.add_argument("--tiny", action="store_true", help="deepseek3-tiny in bf16 (CPU smoke run)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=None,
                   help="calls per timing sample (default: about 20 ms worth)")
    p.add_argument("--out", type=Path, default=measure.DEFAULT_RESULTS_DIR)
    p.add_argument("--quick", action="store_true", help="5 timed iterations")
    p.add_argument("--compare-bf16-output", action="store_true",
                   help="also time FP8 with the other fp8_dot_bf16_output (same process)")
    a = p.parse_args(argv)
    if a.quick:
        a.iters = min(a.iters, 5)
    if a.iters < 1 or a.warmup < 0 or (a.reps is not None and a.reps < 1):
        print(f"error: --iters {a.iters} and --reps {a.reps} must be >= 1, --warmup {a.warmup} >= 0",
              file=sys.stderr)
        return 2
    try:
        record = run(a.tiny, a.overrides, a.iters, a.warmup, a.out, a.reps, a.compare_bf16_output)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(record)
    print(f"wrote {record['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
