"""Training-step benchmark: the DeepSeek-V3 proxy on one GPU, ours vs the two baselines.

    PYTHONPATH=src python3 benchmarks/step.py [--steps N] [--out DIR] [--commit SHA]   # GPU
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/step.py --tiny                # CPU smoke

Every case is the config a user gets from ``dropless train``: the loader's
preset plus key=value overrides (``BASE``: ``model_name=deepseek3-proxy`` with
synthetic tokens, cuDNN flash attention and
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92``; then the case's ``CASE_OVERRIDES``;
then ``--batch``, ``--remat``, ``--custom`` and ``--set KEY=VALUE ...``). So
``python -m dropless train <the row's overrides>`` trains exactly what a row
measured. ``--tiny`` starts from ``deepseek3-tiny`` instead (``TINY_BASE``).
The config's environment keys and XLA flags are applied in each case's
process before JAX starts, as ``dropless train`` applies them. ``DROPLESS_*``
environment variables are not read (the record must say all that was set).

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
  ours_fp8_blockwise  the same with ``te_fp8_blockwise`` grouped GEMMs as
            users get them (``gmm_fp8_impl=auto``: on Hopper the FP8 Mosaic
            kernels with ``auto``'s quantizers, the Mosaic GPU weight kernel and
            the Pallas activation kernels; elsewhere the emulation; the
            row's ``gmm_fp8_impl_resolved`` says which) and the default
            ``fp8_min_dim=4096`` (MLA's narrow projections and the shared
            experts stay bf16)
  ours_fp8_all  ``ours_fp8_blockwise`` with ``fp8_min_dim=0``: every dense
            projection in FP8
  ours_fp8_bf16out, ours_fp8_all_bf16out  ``ours_fp8_blockwise`` and ``ours_fp8_all``
            with ``fp8_dot_bf16_output=true``: the FP8 dense GEMMs write bf16
            (power-of-two scales) instead of float32 then a convert pass
  ours_minimal, ours_fp8_minimal  ``ours`` and ``ours_fp8_blockwise`` under
            ``remat_policy=minimal``: the backward pass runs each attention forward
            again and rebuilds q, k, v (the preset's ``minimal_with_context`` keeps
            them and cuDNN's softmax statistics; 1.044x bf16 on one H200,
            ``step-20261206-215959``)
  ours_fp8_halves  ``ours_fp8_blockwise`` with
            ``gmm_fp8_kernel_schedule=halves_unfenced``: each FP8 kernel step as two
            wgmmas over column halves, the forward's and dgrad's scale reads unfenced
  ours_fp8_p96_32  ``ours_fp8_blockwise`` with
            ``gmm_fp8_kernel_schedule=p96_32_unfenced`` (a 96- and a 32-column wgmma)
  ours_fp8_xhalves  ``ours_fp8_blockwise`` with
            ``gmm_fp8_kernel_schedule=xhalves_unfenced`` (the halves across steps)
  ours_fp8_narrow  ``ours_fp8_blockwise`` with ``gmm_fp8_kernel_schedule=narrow``: the
            kernels' 128x128 CTA tiles (the default is ``wide_o192_n160``)
  ours_fp8_o192, ours_fp8_n160, ours_fp8_n192, ours_fp8_o192_n160, ours_fp8_o192_n192
            ``ours_fp8_blockwise`` with ``gmm_fp8_kernel_schedule=wide_...``: the
            forward and dgrad with 128x192 CTA tiles (o192), the wgrad with 128x160 or
            128x192 (n160, n192), or both
  ours_fp8_under  ``ours_fp8_blockwise`` with
            ``gmm_fp8_kernel_schedule=wide_o192_n160_under``: the default's tiles, each
            step's scale reads and their fence under its wgmma instead of before it
  ours_fp8_swiglu  ``ours_fp8_blockwise`` with ``gmm_fp8_fused_swiglu=true``: SwiGLU's
            output quantized in the pass that computes it
  ours_fp8e ``ours_fp8_blockwise`` emulated (``gmm_fp8_impl=emulate``:
            quantize -> dequantize -> bf16 kernel)
  ours_fp8k ``ours_fp8_blockwise`` through the FP8 Mosaic kernels with XLA's
            quantization passes (``gmm_fp8_impl=kernel gmm_fp8_quantizer=xla``;
            Hopper only)
  ours_fp8kp ``ours_fp8k`` with the single-pass Pallas quantizers
            (``gmm_fp8_quantizer=pallas``: on Triton, the weight's too)
  ours_fp8km ``ours_fp8k`` with every operand quantized by the Mosaic GPU
            kernels (``gmm_fp8_quantizer=mosaic``)
  ours_gfp8kp  ``ours_fp8kp``'s grouped GEMMs with bf16 dense projections: what
            the FP8 grouped GEMMs alone give the step
  ours_fp8kp_head  ``ours_fp8kp`` with the output head in FP8 too
            (``quantize_output_head=true``; the head is 43% of the proxy's
            dense-matmul time and 1.33x faster in FP8 alone, fp8_dense.py)
  ours_mla_unpadded  ``ours`` with ``cudnn_mla_unpadded_v=true``: cuDNN
            attention takes MLA's v at V=128 instead of zero-padded to
            Q=192 (jax's private cuDNN API; cuDNN >= 9.10, Hopper). The
            default ``auto`` does this where it runs, so ``ours`` does too
            since it became the default; ``ours_mla_padded`` is the padded one
  ours_mla_padded  ``ours`` with ``cudnn_mla_unpadded_v=false``
  ours_scan ``ours`` with ``scan_layers=true``: the layers stacked under one
            ``lax.scan`` (the same-run baseline for the unrolled layers)
  ours_align64  ``ours`` with ``moe_group_alignment=64``: every expert's rows
            padded to whole 64-row kernel steps, so the bf16 wgrad kernel
            masks no rows (``benchmarks/notes/gmm.md``: the masked boundary
            steps, not the SM balance, cost most of wgrad's skew loss)
  ours_align128  ``ours`` with ``moe_group_alignment=128``: whole 128-row
            forward and dgrad tiles too (no tile visited once per group it
            holds), for about 2x the padding rows of ``ours_align64``

A case that runs out of memory is retried with half the batch, down to 1 per
device; the JSON says which batch each case ran at. Figures: median step time
over ``--steps`` timed steps after ``--warmup`` steps (compile, autotuning),
tokens/s, TFLOP/s per device from the analytic MaxText-convention count
(``dropless.train.flops``: useful dropless FLOPs, so the capacity baseline is
credited with the same work whatever it computes), MFU against the device's
bf16 peak (the FP8 peak for the FP8 cases), peak device memory, and beside it
``perf.memory``'s estimate for the same config (``estimated_peak_gb``), and
the first step's wall time, compile and autotuning included (``first_step_s``:
what a user waits for before training starts; unrolled layers compile longer),
and the GPU's SM clock, power and throttle reasons over the timed steps
(``gpu_clocks``, ``perf.clocks``: the step runs power-capped, below the clock
that short kernel timings see), printed as a line per case under the table.
Like ``dropless train``, each case uses the compilation cache of its
``jax_cache_dir`` (default ``~/jax_cache``; ``--set jax_cache_dir=`` for none),
so a case compiled before loads its step and its first step is the cached
user's wait (the row's ``jax_cache_dir`` says which cache).

Writes ``<out>/step-<time>-<gpu>.json`` with the GPU, jax version, commit,
environment, the base and case overrides, and every case with its overrides
and resolved config. The record is rewritten after each case (``"partial":
true`` until the last), so a run cut short keeps the cases it finished.
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

CASES = ("xla", "capacity", "ours", "ours_fp8", "ours_fp8_blockwise")
QWEN3_CASE = "qwen3-moe-proxy"  # ``ours`` on the Qwen3-MoE proxy instead of the DeepSeek one
MIXTRAL_CASE = "mixtral-proxy"  # ``ours`` on the Mixtral proxy
EXTRA_CASES = ("ours_fp8_all", "ours_fp8_narrow", "ours_fp8_halves", "ours_fp8_p96_32", "ours_fp8_xhalves",
               "ours_fp8_o192", "ours_fp8_n160", "ours_fp8_n192", "ours_fp8_o192_n160",
               "ours_fp8_o192_n192", "ours_fp8_under", "ours_fp8_swiglu", "ours_fp8_wq_once", "ours_fp8e", "ours_fp8k", "ours_fp8kp",
               "ours_fp8km", "ours_fp8kp_head", "ours_gfp8kp", "ours_mla_unpadded",
               "ours_mla_padded", "ours_scan", "ours_align64", "ours_align128",
               "ours_fp8_bf16out", "ours_fp8_all_bf16out", "ours_minimal", "ours_fp8_minimal",
               QWEN3_CASE, MIXTRAL_CASE)
QUICK_CASES = ("xla", "capacity", "ours")
FP8_DENSE = "te_fp8_currentscaling"
RESULT_PREFIX = "STEP_RESULT "


# The benchmark is the preset users run, plus overrides: the base below, then
# the case's, then the command line's (--batch, --remat, --custom, --set).
BASE = ["model_name=deepseek3-proxy", "dataset_type=synthetic",
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.92"]
TINY_BASE = ["model_name=deepseek3-tiny", "dataset_type=synthetic", "per_device_batch_size=4",
             "max_target_length=64", "remat_policy=full"]
# ours_fp8_blockwise's overrides, which its variants below extend with one or two keys.
FP8_BLOCKWISE = ["gmm_backend=auto", "te_gmm_quantization=te_fp8_blockwise", f"quantization={FP8_DENSE}"]
CASE_OVERRIDES = {
    "xla": ["gmm_backend=xla"],
    "capacity": ["sparse_matmul=false", "capacity_factor=1.0"],
    "ours": ["gmm_backend=auto"],
    "ours_fp8": ["gmm_backend=auto", "te_gmm_quantization=te_mxfp8", f"quantization={FP8_DENSE}"],
    "ours_fp8_blockwise": [*FP8_BLOCKWISE],
    "ours_fp8_all": [*FP8_BLOCKWISE, "fp8_min_dim=0"],
    "ours_fp8_bf16out": [*FP8_BLOCKWISE, "fp8_dot_bf16_output=true"],
    "ours_fp8_all_bf16out": [*FP8_BLOCKWISE, "fp8_min_dim=0", "fp8_dot_bf16_output=true"],
    # The preset's policy before minimal_with_context: cuDNN's attention forward again
    # in the backward pass (remat.CUDNN_ATTENTION_FWD), for 1.5 GiB less on the proxy.
    "ours_minimal": ["gmm_backend=auto", "remat_policy=minimal"],
    "ours_fp8_minimal": [*FP8_BLOCKWISE, "remat_policy=minimal"],
    "ours_fp8_halves": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=halves_unfenced"],
    "ours_fp8_p96_32": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=p96_32_unfenced"],
    "ours_fp8_xhalves": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=xhalves_unfenced"],
    "ours_fp8_narrow": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=narrow"],
    "ours_fp8_o192": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=wide_o192"],
    "ours_fp8_n160": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=wide_n160"],
    "ours_fp8_n192": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=wide_n192"],
    "ours_fp8_o192_n160": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=wide_o192_n160"],
    "ours_fp8_o192_n192": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=wide_o192_n192"],
    "ours_fp8_under": [*FP8_BLOCKWISE, "gmm_fp8_kernel_schedule=wide_o192_n160_under"],
    "ours_fp8_swiglu": [*FP8_BLOCKWISE, "gmm_fp8_fused_swiglu=true"],
    # Under gradient accumulation (--set gradient_accumulation_steps=2): the expert
    # weights quantized once per step, against in every microbatch (the default).
    "ours_fp8_wq_once": [*FP8_BLOCKWISE, "gmm_fp8_weights_once_per_step=true"],
    "ours_fp8e": [*FP8_BLOCKWISE, "gmm_fp8_impl=emulate"],
    "ours_fp8k": [*FP8_BLOCKWISE, "gmm_fp8_impl=kernel", "gmm_fp8_quantizer=xla"],
    "ours_fp8kp": [*FP8_BLOCKWISE, "gmm_fp8_impl=kernel", "gmm_fp8_quantizer=pallas"],
    "ours_fp8km": [*FP8_BLOCKWISE, "gmm_fp8_impl=kernel", "gmm_fp8_quantizer=mosaic"],
    "ours_gfp8kp": ["gmm_backend=auto", "te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=kernel",
                    "gmm_fp8_quantizer=pallas"],
    "ours_fp8kp_head": [*FP8_BLOCKWISE, "gmm_fp8_impl=kernel", "gmm_fp8_quantizer=pallas",
                        "quantize_output_head=true"],
    "ours_mla_unpadded": ["gmm_backend=auto", "cudnn_mla_unpadded_v=true"],
    "ours_mla_padded": ["gmm_backend=auto", "cudnn_mla_unpadded_v=false"],
    "ours_scan": ["gmm_backend=auto", "scan_layers=true"],
    "ours_align64": ["gmm_backend=auto", "moe_group_alignment=64"],
    "ours_align128": ["gmm_backend=auto", "moe_group_alignment=128"],
    QWEN3_CASE: ["gmm_backend=auto"],
    MIXTRAL_CASE: ["gmm_backend=auto"],
}
# Cases on another preset than the base's: (full-size, tiny) model_name.
CASE_MODEL = {QWEN3_CASE: ("qwen3-moe-proxy", "qwen3-moe-tiny"), MIXTRAL_CASE: ("mixtral-proxy", "mixtral-tiny")}


def parse_custom(text: str) -> list[str]:
    """``--custom "decoder_layer_input=offload,mlpwo=device"`` -> overrides ``["decoder_layer_input=offload", ...]``.

    Raises:
      ValueError: an item that is not name=action (names and actions are
        checked by the config loader).
    """
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, action = item.partition("=")
        if not sep or not name or not action:
            raise ValueError(f"--custom item {item!r} is not name=action (e.g. decoder_layer_input=offload)")
        pairs.append(f"{name.strip()}={action.strip()}")
    return pairs


def case_overrides(case: str, tiny: bool, batch: float | None = None, remat: str | None = None,
                   custom: str = "", extra=()) -> list[str]:
    """The key=value list of one case, as ``dropless train`` would take it."""
    out = list(TINY_BASE if tiny else BASE) + CASE_OVERRIDES[case]
    if case in CASE_MODEL:
        name = CASE_MODEL[case][tiny]
        out = [f"model_name={name}" if o.startswith("model_name=") else o for o in out]
    out += [f"per_device_batch_size={batch:g}"] if batch else []
    out += [f"remat_policy={remat}"] if remat else []
    if custom:
        if remat != "custom":
            got = repr(remat) if remat else "the preset's remat_policy"
            raise ValueError(f"--custom needs --remat custom, not {got}")
        out += parse_custom(custom)
    return out + list(extra)


def resolve_case(case: str, tiny: bool, batch=None, remat=None, custom: str = "", extra=()):
    """(overrides, validated Config) of one case; raises ConfigError on a bad override."""
    from dropless.config.loader import load_config

    overrides = case_overrides(case, tiny, batch, remat, custom, extra)
    return overrides, load_config(None, overrides, environ={}).config


def memory_estimate(cfg) -> dict | None:
    """``perf.memory``'s per-device estimate of this case (1 device), or {"error": ...}."""
    from dropless.perf import memory

    try:
        train = cfg.train()
        est = memory.estimate(cfg.model(), per_device_batch=int(train.per_device_batch_size),
                              seq=train.max_target_length, accum=train.gradient_accumulation_steps,
                              mesh_shape={"data": 1, "fsdp": 1, "expert": 1, "tensor": 1},
                              optimizer=cfg.optimizer())
    except Exception as e:  # noqa: BLE001 - the estimate must not cost the measurement
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {k: v for k, v in est.to_dict().items() if k != "mesh"}


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def run_case(case: str, tiny: bool, batch, remat, steps: int, warmup: int, custom: str = "",
             extra=()) -> dict:
    """Build, warm up and time one case in this process; returns its result row.

    The config's environment keys and XLA flags are applied first, as ``dropless
    train`` does, so JAX must not have started in this process.
    """
    from dropless.config.xla_flags import apply_runtime_settings, gpu_present

    overrides, cfg = resolve_case(case, tiny, batch, remat, custom, extra)
    applied = apply_runtime_settings(cfg.xla_flags, cfg.env, on_gpu=gpu_present())
    estimate = memory_estimate(cfg)
    import jax

    # The compilation cache as ``dropless train`` uses it (``jax_cache_dir``, default
    # ~/jax_cache): a case compiled before in this cache loads its step, so its
    # compile+1st time is the cached one (the row names the directory). Not for the
    # CPU smoke run (--tiny), which must leave the home directory alone.
    cache_dir = None
    if cfg.jax_cache_dir and not tiny:
        from dropless.cli import use_compilation_cache

        cache_dir = use_compilation_cache(cfg.jax_cache_dir)

    from dropless.ops.gmm import resolve_backend
    from dropless.perf import profile
    from dropless.perf.clocks import ClockSampler
    from dropless.train import flops as flops_lib
    from dropless.train.loop import build

    model, train = cfg.model(), cfg.train()
    train = dataclasses.replace(train, steps=warmup + steps)
    built = build(model, train, cfg.mesh())
    batches = [next(built.batches) for _ in range(2)]  # host data stays out of the timing
    state, metrics = built.state, None
    first_step_s, t0 = None, time.perf_counter()
    for i in range(warmup):
        state, metrics = built.step_fn(state, batches[i % 2])
        if i == 0:  # what a user waits before the first step's line: compile, autotune, one step
            jax.block_until_ready((state, metrics))
            first_step_s = time.perf_counter() - t0
    jax.block_until_ready((state, metrics))
    times, losses = [], []
    # A sustained step runs at the power limit, below the rated clock: the row says at which.
    with ClockSampler() as clocks, clocks.window("timed"):
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
        "gmm_backend": resolve_backend(model.moe.gmm_backend) if model.moe.sparse_matmul else "capacity",
        "quantization": model.quantization,
        "gmm_quantization": model.moe.gmm_quantization,
        "gmm_fp8_impl_resolved": profile.fp8_impls(model, train),
        "mfu_peak": precision,
        "per_device_batch_size": train.per_device_batch_size,
        "remat_policy": model.remat_policy,
        "remat_custom": [list(pair) for pair in model.remat_custom],
        "step_time_s": step_time,
        "step_times_s": times,
        "first_step_s": first_step_s,
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_device": tokens / step_time / jax.device_count(),
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "model_tflop_per_step_per_device": built.tflops_per_step,
        "peak_memory_gb": stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None,
        "bytes_limit_gb": stats.get("bytes_limit", 0) / 2**30 if stats else None,
        "estimated_peak_gb": estimate.get("total_gib"),
        "memory_estimate": estimate,
        "overrides": overrides,
        "config": cfg.model_dump(mode="json"),
        "xla_flags_applied": applied,
        "jax_cache_dir": cache_dir,
        "gpu": device.device_kind,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "dropped_tokens_last_step": int(metrics.get("dropped_tokens", 0)),
        "gpu_clocks": clocks.summary("timed"),
    }


def child_main(args) -> int:
    try:
        row = run_case(args.case, args.tiny, args.batch, args.remat, args.steps, args.warmup,
                       args.custom, args.set)
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
    cmd += ["--set", *args.set] if args.set else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return {"case": case, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}


def run_with_backoff(case, args) -> dict:
    """Run ``case``, halving the batch after each OOM down to 1 per device."""
    _, cfg = resolve_case(case, args.tiny, args.batch, args.remat, args.custom, args.set)
    batch, tried = cfg.per_device_batch_size, []
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


def print_table(rows, tiny: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    from dropless.perf.clocks import format_summary

    table = Table("case", "backend", "batch/dev", "step (ms)", "tokens/s", "TFLOP/s/dev", "MFU",
                  "peak mem (GiB)", "est. (GiB)", "compile+1st (s)", "dropped", "note",
                  title="training step, " + ("tiny CPU model" if tiny else "deepseek3-proxy")
                  + f" (cases {QWEN3_CASE}, {MIXTRAL_CASE}: those models)")
    for r in rows:
        if "step_time_s" not in r:
            table.add_row(r["case"], "", "", "", "", "", "", "", "", "", "", r.get("error", "")[:80])
            continue
        notes = ["batch shrunk to fit"] * (len(r.get("batches_tried", [])) > 1)
        notes += ["MFU of the fp8 peak"] * (r.get("mfu_peak") == "fp8")
        note = "; ".join(notes)
        table.add_row(
            r["case"], r["gmm_backend"], f"{r['per_device_batch_size']:g}",
            f"{r['step_time_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.4g}",
            f"{r['tflops_per_device']:.4g}", f"{r['mfu']:.1%}" if r["mfu"] else "-",
            f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-",
            f"{r['estimated_peak_gb']:.1f}" if r.get("estimated_peak_gb") is not None else "-",
            f"{r['first_step_s']:.0f}" if r.get("first_step_s") is not None else "-",
            str(r["dropped_tokens_last_step"]), note,
        )
    Console(width=160).print(table)
    for r in rows:
        if "gpu_clocks" in r:
            print(f"{r['case']}: {format_summary(r['gpu_clocks'])}")


def speedups(rows) -> dict:
    """TFLOP/s/device of ours over each baseline and over the better one; each variant of ours
    over it; each FP8 variant over ``ours_fp8_blockwise`` (the FP8 defaults) of the same run;
    each FP8 case under ``minimal`` (``*_minimal``) over ``ours_minimal``, bf16 under it."""
    by = {r["case"]: r.get("tflops_per_device") for r in rows}
    ours = by.get("ours")
    out = {f"ours_over_{c}": ours / by[c] for c in ("xla", "capacity") if ours and by.get(c)}
    baselines = [by[c] for c in ("xla", "capacity") if by.get(c)]
    if ours and baselines:
        out["ours_over_best_baseline"] = ours / max(baselines)
    for c in by:  # every variant of ours against ours of the same run
        if c.startswith("ours_") and ours and by[c]:
            out[f"{c}_over_ours"] = by[c] / ours
    fp8 = by.get("ours_fp8_blockwise")
    for c in by:
        if c.startswith("ours_fp8") and c != "ours_fp8_blockwise" and fp8 and by[c]:
            out[f"{c}_over_ours_fp8_blockwise"] = by[c] / fp8
    minimal = by.get("ours_minimal")
    for c in by:
        if c.startswith("ours_fp8") and c.endswith("_minimal") and minimal and by[c]:
            out[f"{c}_over_ours_minimal"] = by[c] / minimal
    return out


def write_record(rows, cases, args, started, partial: bool, path: str | None = None) -> str:
    """Write (or rewrite, at ``path``) the results JSON of the cases run so far."""
    import importlib.metadata

    from dropless.perf import measure
    from dropless.perf.provenance import source_digest

    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None)
    if gpu is None and not partial:  # no case ran: ask JAX, now that no child needs the GPU
        import jax

        gpu = jax.devices()[0].device_kind
    record = {
        "benchmark": "step",
        "time": started.isoformat(timespec="seconds"),
        "partial": partial,
        "gpu": gpu,
        "platform": "cpu" if args.tiny else "gpu",
        "device_count": 1,
        "jax": importlib.metadata.version("jax"),
        "commit": args.commit or measure.commit_label(),
        "source_digest": source_digest(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "CUDA_", "NCCL_"))},
        "base_overrides": TINY_BASE if args.tiny else BASE,
        "case_overrides": {c: CASE_OVERRIDES[c] for c in cases},
        "extra_overrides": args.set,
        "steps": args.steps,
        "warmup": args.warmup,
        "cases": rows,
        "speedups": speedups(rows),
    }
    # The file keeps the name of the first write; the rewrites replace it whole.
    name = os.path.basename(path) if path else \
        f"step-{started:%Y%m%d-%H%M%S}-{(gpu or 'unknown').replace(' ', '_')}.json"
    return str(measure.write_record(record, args.out, name=name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model (smoke test of this script)")
    p.add_argument("--quick", action="store_true",
                   help=f"the bf16 cases {QUICK_CASES} with 3 timed steps (dropless bench --quick)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES + EXTRA_CASES}")
    p.add_argument("--batch", type=float, default=None, help="per-device batch (default: the config's)")
    p.add_argument("--remat", default=None, help="remat_policy override (default: the case's preset's, e.g. "
                   "minimal for deepseek3-proxy; --tiny sets full)")
    p.add_argument("--custom", default="", help="with --remat custom: name=remat|device|offload,... "
                   "(e.g. decoder_layer_input=offload,mlpwo=device)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more config overrides for every case (after the case's own)")
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

    try:  # every case's overrides must resolve before any GPU time is spent
        for case in cases:
            resolve_case(case, args.tiny, args.batch, args.remat, args.custom, args.set)
    except ValueError as e:  # ConfigError is a ValueError
        p.error(str(e))
    started = datetime.datetime.now()
    rows, path = [], None
    for i, case in enumerate(cases):
        rows.append(run_with_backoff(case, args))
        path = write_record(rows, cases, args, started, partial=i + 1 < len(cases), path=path)
    print_table(rows, args.tiny)
    print(f"speedups: {speedups(rows)}")
    print(f"wrote {path}")
    return 0 if all("step_time_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
