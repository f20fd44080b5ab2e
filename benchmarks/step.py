"""Training-step benchmark: the DeepSeek-V3 proxy on one GPU, ours vs the two baselines.

    PYTHONPATH=src python3 benchmarks/step.py [--steps N] [--out DIR] [--commit SHA]   # GPU
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/step.py --tiny                # CPU smoke

Model: ``deepseek3-proxy`` (V3's layer shapes: D = 7168, MLA with q_lora 1536,
kv_lora 512, 128 heads of 128 + 64 rope / 128 v, V = 129280; 1 dense layer
(mlp 18432) + 3 MoE layers of 32 experts top-8 (moe_mlp 2048) + 1 shared, in
4 groups with 2 kept, sigmoid routing with the balancing bias), bf16
parameters and activations, AdamW with bf16 first moment, cuDNN flash
attention, seq 4096, synthetic tokens. The sections are built here directly
(no pydantic on the GPU machine); they mirror ``config/models/deepseek3-proxy.yml``.

Cases, each in its own process (so peak memory is per case and an OOM ends
only that attempt):

  xla       dropless MoE through ``lax.ragged_dot`` (``gmm_backend=xla``): the
            unoptimized JAX baseline
  capacity  MaxText's capacity-limited ``dense_matmul`` (``sparse_matmul=False``,
            capacity factor 1.0; drops tokens, counted)
  ours      dropless with the best kernels available (``gmm_backend=auto``)
  ours_fp8  ``ours`` with both FP8 options of the seed recipe: dense projections
            ``quantization=te_fp8_currentscaling`` (cuBLASLt FP8 GEMMs) and
            grouped GEMMs ``te_gmm_quantization=te_mxfp8`` (emulated on Hopper:
            FP8 numerics, bf16 grouped-GEMM speed)
  ours_fp8_blockwise  the same with ``te_fp8_blockwise`` grouped GEMMs
            (emulated: quantize -> dequantize -> bf16 kernel)
  qwen3-moe-proxy  ``ours`` on ``qwen3-moe-proxy`` (Qwen3-30B-A3B's layer
            shapes, 12 layers, batch 4 x 4096; ``qwen3_proxy_sections``), for its
            TFLOP/s/device next to the DeepSeek proxy's (not in the default list)
  ours_fp8k ``ours_fp8_blockwise`` through the FP8 Mosaic kernels
            (``gmm_fp8_impl=kernel``; Hopper only; not in the default list
            until the kernels have passed their GPU tests)

A case that runs out of memory is retried with half the batch, down to 1 per
device; the JSON says which batch each case ran at. Figures: median step time
over ``--steps`` timed steps after ``--warmup`` steps (compile, autotuning),
tokens/s, TFLOP/s per device from the analytic MaxText-convention count
(``dropless.train.flops``: useful dropless FLOPs, so the capacity baseline is
credited with the same work whatever it computes), MFU against the device's
bf16 peak (the FP8 peak for the FP8 cases), and peak device memory.

Writes ``<out>/step-<time>-<gpu>.json`` with the GPU, jax version, commit,
environment, the sections and every case.
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

# One case per process, so it may take nearly all of the GPU's memory (JAX's default is 75%).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

CASES = ("xla", "capacity", "ours", "ours_fp8", "ours_fp8_blockwise")
QWEN3_CASE = "qwen3-moe-proxy"  # ``ours`` on the Qwen3-MoE proxy instead of the DeepSeek one
EXTRA_CASES = ("ours_fp8k", QWEN3_CASE)
QUICK_CASES = ("xla", "capacity", "ours")
FP8_DENSE = "te_fp8_currentscaling"
RESULT_PREFIX = "STEP_RESULT "


def proxy_sections(tiny: bool):
    """(ModelConfig, TrainConfig) of the benchmark; ``tiny`` is a CPU-sized stand-in."""
    from dropless.config.sections import (DataConfig, MLAConfig, ModelConfig, MoEConfig,
                                          OptimizerConfig, TrainConfig)

    data = DataConfig(dataset_type="synthetic", data_seed=0)
    opt = OptimizerConfig(learning_rate=1e-4, mu_dtype="bfloat16")
    moe_common = dict(routed_score_func="sigmoid", norm_topk_prob=True, routed_bias=True,
                      routed_bias_update_rate=1e-3, shared_experts=1)
    if tiny:
        model = ModelConfig(
            vocab_size=256, emb_dim=64, num_decoder_layers=4, first_num_dense_layers=1,
            mlp_dim=128, remat_policy="full",
            mla=MLAConfig(num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16),
            moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=64,
                          n_routing_groups=4, topk_routing_group=2, **moe_common),
        )
        train = TrainConfig(per_device_batch_size=4, max_target_length=64, data=data, optimizer=opt)
        return model, train
    model = ModelConfig(
        vocab_size=129280, emb_dim=7168, num_decoder_layers=4, first_num_dense_layers=1,
        mlp_dim=18432, dtype="bfloat16", weight_dtype="bfloat16", remat_policy="full",
        mla=MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, rope_factor=40.0,
                      original_max_position_embeddings=4096, attention="cudnn_flash_te"),
        moe=MoEConfig(num_experts=32, num_experts_per_tok=8, moe_mlp_dim=2048,
                      n_routing_groups=4, topk_routing_group=2, routed_scaling_factor=2.5,
                      **moe_common),
    )
    train = TrainConfig(per_device_batch_size=2, max_target_length=4096, data=data, optimizer=opt)
    return model, train


def qwen3_proxy_sections(tiny: bool):
    """(ModelConfig, TrainConfig) of the ``qwen3-moe-proxy`` case; mirrors
    ``config/models/qwen3-moe-proxy.yml`` (Qwen3-30B-A3B's layers: D = 2048, GQA
    32 / 4 heads of 128 with q/k norm, 128 experts top-8 of F = 768, softmax
    routing, no shared expert, V = 151936; 12 layers), cuDNN attention."""
    from dropless.config.sections import (DataConfig, GQAConfig, ModelConfig, MoEConfig,
                                          OptimizerConfig, TrainConfig)

    data = DataConfig(dataset_type="synthetic", data_seed=0)
    opt = OptimizerConfig(learning_rate=1e-4, mu_dtype="bfloat16")
    moe_common = dict(routed_score_func="softmax", norm_topk_prob=True, shared_experts=0,
                      load_balance_loss_weight=0.008)
    if tiny:
        model = ModelConfig(
            vocab_size=256, emb_dim=64, num_decoder_layers=2, first_num_dense_layers=0,
            remat_policy="full", attention_type="gqa",
            gqa=GQAConfig(num_heads=4, num_kv_heads=2, head_dim=16, use_qk_norm=True, rope_theta=1e6),
            moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=64, **moe_common),
        )
        return model, TrainConfig(per_device_batch_size=4, max_target_length=64, data=data, optimizer=opt)
    model = ModelConfig(
        vocab_size=151936, emb_dim=2048, num_decoder_layers=12, first_num_dense_layers=0,
        mlp_dim=6144, dtype="bfloat16", weight_dtype="bfloat16", remat_policy="full",
        attention_type="gqa",
        gqa=GQAConfig(num_heads=32, num_kv_heads=4, head_dim=128, use_qk_norm=True, rope_theta=1e6,
                      attention="cudnn_flash_te"),
        moe=MoEConfig(num_experts=128, num_experts_per_tok=8, moe_mlp_dim=768, **moe_common),
    )
    return model, TrainConfig(per_device_batch_size=4, max_target_length=4096, data=data, optimizer=opt)


def parse_custom(text: str) -> tuple[tuple[str, str], ...]:
    """``--custom "decoder_layer_input=offload,mlpwo=device"`` -> ``remat_custom`` pairs.

    Raises:
      ValueError: an item that is not name=action (names and actions are
        checked by ``train.remat`` when the model is built).
    """
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, action = item.partition("=")
        if not sep or not name or not action:
            raise ValueError(f"--custom item {item!r} is not name=action (e.g. decoder_layer_input=offload)")
        pairs.append((name.strip(), action.strip()))
    return tuple(pairs)


def case_sections(case: str, tiny: bool, batch: float | None, remat: str | None,
                  custom: str = ""):
    """The sections of one case (``--batch`` / ``--remat`` / ``--custom`` override the defaults)."""
    model, train = (qwen3_proxy_sections if case == QWEN3_CASE else proxy_sections)(tiny)
    moe = {"xla": dict(gmm_backend="xla"),
           "capacity": dict(sparse_matmul=False, capacity_factor=1.0),
           "ours": dict(gmm_backend="auto"),
           QWEN3_CASE: dict(gmm_backend="auto"),
           "ours_fp8": dict(gmm_backend="auto", gmm_quantization="te_mxfp8"),
           "ours_fp8_blockwise": dict(gmm_backend="auto", gmm_quantization="te_fp8_blockwise"),
           "ours_fp8k": dict(gmm_backend="auto", gmm_quantization="te_fp8_blockwise",
                             gmm_fp8_impl="kernel"),
           }[case]
    model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, **moe))
    if case.startswith("ours_fp8"):
        model = dataclasses.replace(model, quantization=FP8_DENSE)
    if remat:
        model = dataclasses.replace(model, remat_policy=remat)
    if custom:
        if model.remat_policy != "custom":
            raise ValueError(f"--custom needs --remat custom, not {model.remat_policy!r}")
        model = dataclasses.replace(model, remat_custom=parse_custom(custom))
    if batch:
        train = dataclasses.replace(train, per_device_batch_size=batch)
    return model, train


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def run_case(case: str, tiny: bool, batch, remat, steps: int, warmup: int, custom: str = "") -> dict:
    """Build, warm up and time one case in this process; returns its result row."""
    import jax

    from dropless.config.sections import MeshConfig
    from dropless.ops.gmm import resolve_backend
    from dropless.train import flops as flops_lib
    from dropless.train.loop import build

    model, train = case_sections(case, tiny, batch, remat, custom)
    train = dataclasses.replace(train, steps=warmup + steps)
    built = build(model, train, MeshConfig())
    batches = [next(built.batches) for _ in range(2)]  # host data stays out of the timing
    state, metrics = built.state, None
    for i in range(warmup):
        state, metrics = built.step_fn(state, batches[i % 2])
    jax.block_until_ready((state, metrics))
    times, losses = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = built.step_fn(state, batches[i % 2])
        losses.append(float(metrics["loss"]))  # the fetch waits for the step
        times.append(time.perf_counter() - t0)
    step_time = statistics.median(times)
    device = jax.devices()[0]
    precision = flops_lib.precision_of(model)
    peak = None if device.platform == "cpu" else flops_lib.peak_tflops(device.device_kind, precision)
    stats = device.memory_stats() or {}
    tokens = built.global_batch * train.max_target_length * train.gradient_accumulation_steps
    tflops = built.tflops_per_step / step_time
    return {
        "case": case,
        "model": "qwen3-moe-proxy" if case == QWEN3_CASE else "deepseek3-proxy",
        "gmm_backend": resolve_backend(model.moe.gmm_backend) if model.moe.sparse_matmul else "capacity",
        "quantization": model.quantization,
        "gmm_quantization": model.moe.gmm_quantization,
        "mfu_peak": precision,
        "per_device_batch_size": train.per_device_batch_size,
        "remat_policy": model.remat_policy,
        "remat_custom": [list(pair) for pair in model.remat_custom],
        "step_time_s": step_time,
        "step_times_s": times,
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_device": tokens / step_time / jax.device_count(),
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "model_tflop_per_step_per_device": built.tflops_per_step,
        "peak_memory_gb": stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "dropped_tokens_last_step": int(metrics.get("dropped_tokens", 0)),
    }


def child_main(args) -> int:
    try:
        row = run_case(args.case, args.tiny, args.batch, args.remat, args.steps, args.warmup,
                       args.custom)
    except Exception as e:  # noqa: BLE001 - report OOM to the parent as a result
        if _is_oom(e):
            print(RESULT_PREFIX + json.dumps({"case": args.case, "oom": True, "error": str(e)[:2000]}))
            return 0
        raise
    print(RESULT_PREFIX + json.dumps(row))
    return 0


def _spawn(case, batch, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--case", case, "--batch",
           str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--remat", args.remat] if args.remat else []
    cmd += ["--custom", args.custom] if args.custom else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return {"case": case, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}


def run_with_backoff(case, args) -> dict:
    """Run ``case``, halving the batch after each OOM down to 1 per device."""
    _, train = case_sections(case, args.tiny, args.batch, args.remat, args.custom)
    batch, tried = train.per_device_batch_size, []
    while True:
        print(f"[{case}] per_device_batch_size={batch} ...", flush=True)
        row = _spawn(case, batch, args)
        tried.append(batch)
        if not row.get("oom") or batch <= 1:
            break
        print(f"[{case}] out of memory at batch {batch}; halving", flush=True)
        batch = max(1, batch // 2)
    row["batches_tried"] = tried
    if row.get("oom"):
        row["error"] = f"out of memory even at per_device_batch_size={batch}"
    return row


def _git_commit() -> str:
    """The commit from git, else $DROPLESS_COMMIT (the GPU machine's copy has no .git)."""
    from dropless.perf.measure import git_commit

    info = git_commit()
    return info["commit"] + ("-dirty" if info["dirty"] else "")


def print_table(rows, tiny: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("case", "backend", "batch/dev", "step (ms)", "tokens/s", "TFLOP/s/dev", "MFU",
                  "peak mem (GiB)", "dropped", "note",
                  title="training step, " + ("tiny CPU model" if tiny else "deepseek3-proxy")
                  + f" (case {QWEN3_CASE}: that model)")
    for r in rows:
        if "step_time_s" not in r:
            table.add_row(r["case"], "", "", "", "", "", "", "", "", r.get("error", "")[:80])
            continue
        notes = ["batch shrunk to fit"] * (len(r.get("batches_tried", [])) > 1)
        notes += ["MFU of the fp8 peak"] * (r.get("mfu_peak") == "fp8")
        note = "; ".join(notes)
        table.add_row(
            r["case"], r["gmm_backend"], f"{r['per_device_batch_size']:g}",
            f"{r['step_time_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.4g}",
            f"{r['tflops_per_device']:.4g}", f"{r['mfu']:.1%}" if r["mfu"] else "-",
            f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-",
            str(r["dropped_tokens_last_step"]), note,
        )
    Console(width=160).print(table)


def speedups(rows) -> dict:
    """TFLOP/s/device of ours over each baseline and over the better one; FP8 over bf16."""
    by = {r["case"]: r.get("tflops_per_device") for r in rows}
    ours = by.get("ours")
    out = {f"ours_over_{c}": ours / by[c] for c in ("xla", "capacity") if ours and by.get(c)}
    baselines = [by[c] for c in ("xla", "capacity") if by.get(c)]
    if ours and baselines:
        out["ours_over_best_baseline"] = ours / max(baselines)
    for c in ("ours_fp8", "ours_fp8_blockwise", "ours_fp8k"):
        if ours and by.get(c):
            out[f"{c}_over_ours"] = by[c] / ours
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model (smoke test of this script)")
    p.add_argument("--quick", action="store_true",
                   help=f"the bf16 cases {QUICK_CASES} with 3 timed steps (dropless bench --quick)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES + EXTRA_CASES}")
    p.add_argument("--batch", type=float, default=None, help="per-device batch (default: the config's)")
    p.add_argument("--remat", default=None, help="remat_policy override (default: full)")
    p.add_argument("--custom", default="", help="with --remat custom: name=remat|device|offload,... "
                   "(e.g. decoder_layer_input=offload,mlpwo=device)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, autotune)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.quick:
        if args.cases == ",".join(CASES):
            args.cases = ",".join(QUICK_CASES)
        args.steps = min(args.steps, 3)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES + EXTRA_CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {CASES + EXTRA_CASES}")

    import jax

    device = jax.devices()[0]
    rows = [run_with_backoff(case, args) for case in cases]
    print_table(rows, args.tiny)
    model, train = proxy_sections(args.tiny)
    record = {
        "benchmark": "step",
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "commit": args.commit or _git_commit(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "CUDA_", "NCCL_"))},
        "model": dataclasses.asdict(model),
        "train": dataclasses.asdict(train),
        "steps": args.steps,
        "warmup": args.warmup,
        "cases": rows,
        "speedups": speedups(rows),
    }
    os.makedirs(args.out, exist_ok=True)
    name = f"step-{datetime.datetime.now():%Y%m%d-%H%M%S}-{device.device_kind.replace(' ', '_')}.json"
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"speedups: {record['speedups']}")
    print(f"wrote {path}")
    return 0 if all("step_time_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
