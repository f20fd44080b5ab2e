"""The FP8 sections of ``benchmarks/RESULTS.md``: the grouped GEMM kernels alone
(``benchmarks/fp8_kernel_probe.py``), the quantization passes and the kernel path's
products (``benchmarks/fp8_quant.py``), and the dense matmuls in bf16 against FP8
(``benchmarks/fp8_dense.py``).
"""

from pathlib import Path

from dropless.perf.report_md import TITLES, _num, _ratio, _source_line, md_table

FP8_TARGETS = {"fwd": 1250.0, "dgrad": 1250.0, "wgrad": 1100.0}  # TF/s, kernels alone (issue 12)


def _reached(value, target) -> str:
    """A throughput against its target (higher is better)."""
    if value is None or target is None:
        return "-"
    return f"{target:.0f}: " + ("met" if value >= target else "**not met**")


def fp8_kernel_rows(record: dict) -> list[dict]:
    """Timed rows of an ``fp8_kernels`` record (``benchmarks/fp8_kernel_probe.py``)."""
    return [r for r in record.get("rows", []) if r.get("tflops_kernel")]


def fp8_kernels_headline(record: dict) -> list[str]:
    """The best kernel TF/s of each product against its target."""
    best = {}
    for r in fp8_kernel_rows(record):
        best[r["product"]] = max(best.get(r["product"], 0.0), r["tflops_kernel"])
    if not best:
        return []
    return ["FP8 kernels alone (CUPTI): " + ", ".join(
        f"{p} {v:.0f} TF/s (target {FP8_TARGETS[p]:.0f})" for p, v in best.items()
        if p in FP8_TARGETS)]


def fp8_kernels_section(record: dict, path: Path, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the FP8 kernels alone: each variant and product against the targets."""
    cfg = record.get("config") or {}
    rows = fp8_kernel_rows(record)
    body = [[r["variant"], r["product"], _num(r["kernel_ms"], ".3f"), _num(r["wall_ms"], ".3f"),
             _num(r["tflops_kernel"], ".0f"), _num(r["tflops_wall"], ".0f"),
             _reached(r["tflops_kernel"], FP8_TARGETS.get(r["product"]))] for r in rows]
    checks = [f"{r['product']} {r['variant']} == {r['bitwise_equal_to']}: {r['equal']}"
              for r in record.get("rows", []) if "bitwise_equal_to" in r]
    parts = [f"## {TITLES['fp8_kernels']}", _source_line(record, path), "",
             "Shape: " + ", ".join(f"`{k}={cfg[k]}`" for k in ("M", "G", "K", "N", "layout")
                                   if k in cfg), "",
             md_table(["variant", "product", "kernel ms", "wall ms", "TF/s (CUPTI)", "TF/s (wall)",
                       "target"], body, labels=2) if body else "_no rows in the record_"]
    if checks:
        parts += ["", "Bit-for-bit agreement between variants: " + "; ".join(checks) + "."]
    return "\n".join(parts)


def fp8_quant_section(record: dict, path: Path, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the FP8 quantization passes and the kernel path's products."""
    rows = record.get("rows", [])
    passes = [r for r in rows if r.get("section") == "pass" and "error" not in r]
    products = [r for r in rows if r.get("section") == "product" and "error" not in r]
    copy = next((r for r in passes if r["name"] == "copy"), None)
    body = [[r["name"], _num(r.get("kernel_ms"), ".3f"), _num(r.get("wall_ms"), ".3f"),
             _num(r.get("gbps_kernel"), ",.0f"),
             _ratio(r.get("gbps_kernel"), copy and copy.get("gbps_kernel"))] for r in passes]
    bf16 = next((r for r in products if r["name"] == "fwd+bwd bf16 kernel"), None)
    pbody = [[r["name"], _num(r.get("kernel_ms"), ".3f"), _num(r.get("wall_ms"), ".3f"),
              _num(r.get("tflops_kernel"), ".0f"),
              _ratio(bf16 and bf16.get("kernel_ms"), r.get("kernel_ms")) if "bwd" in r["name"]
              else "-"] for r in products]
    parts = [f"## {TITLES['fp8_quant']}", _source_line(record, path), ""]
    if record.get("note"):
        parts += [f"Note: {record['note']}", ""]
    parts += ["Quantization passes (GB/s moved: input read once, outputs written once; "
              "`copy` is a plain bf16 pass, the bandwidth a single pass can reach):", "",
              md_table(["pass", "kernel ms", "wall ms", "GB/s (CUPTI)", "vs copy"], body)
              if body else "_no passes_", "",
              "Products (fwd+dgrad+wgrad where named `fwd+bwd`; the ratio is bf16's kernel time "
              "over the row's):", "",
              md_table(["product", "kernel ms", "wall ms", "TF/s (CUPTI)", "vs bf16"], pbody)
              if pbody else "_no products (no Hopper GPU)_"]
    return "\n".join(parts)


def fp8_quant_headline(record: dict) -> list[str]:
    """The kernel path's fwd+dgrad+wgrad (quantization included) against bf16's: with the
    Pallas quantizers (the default) when the record has them, and with XLA's."""
    by = {r["name"]: r for r in record.get("rows", []) if r.get("section") == "product"}
    pallas, xla, alone, bf16 = (by.get(n, {}).get("kernel_ms") for n in (
        "fwd+bwd kernel path, pallas q", "fwd+bwd kernel path", "fwd+bwd FP8 kernels alone",
        "fwd+bwd bf16 kernel"))
    path = pallas or xla
    if not (path and bf16):
        return []
    line = (f"FP8 fwd+dgrad+wgrad with quantization{' (Pallas quantizers)' if pallas else ''} "
            f"{path:.1f} ms = {bf16 / path:.2f}x bf16's {bf16:.1f} ms")
    extras = [f"XLA's quantization {xla:.1f} ms = {bf16 / xla:.2f}x"] if pallas and xla else []
    extras += [f"kernels alone {alone:.1f} ms = {bf16 / alone:.2f}x"] if alone else []
    return [line + (f" ({'; '.join(extras)})" if extras else "")]


def fp8_loss_headline(record: dict) -> list[str]:
    """Each FP8 recipe's final LM loss against bf16's (``fp8_loss.py``)."""
    rows = [r for r in record.get("rows", []) if r.get("rel_diff") is not None and r["case"] != "bf16"]
    if not rows:
        return []
    cfg = record.get("config") or {}
    judged = cfg.get("judged", True)
    return [f"final LM loss vs bf16 after {cfg.get('steps')} steps: " + ", ".join(
        f"{r['case']} {r['rel_diff']:+.2%}" + ("" if r.get("passed") or not judged else " (over 1%)")
        for r in rows) + ("" if judged else " (a smoke run: the 1% target is not judged)")]


def fp8_dense_section(record: dict, path: Path, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the dense matmuls in bf16 against te_fp8_currentscaling (fp8_dense.py)."""
    rows = [r for r in record.get("rows", []) if "bf16" in r and "fp8" in r]
    # hlo_check < 2: the parser saw no operand types on the GPU and counted 0 FP8 dots.
    unchecked = [r for r in rows if r["fp8"].get("hlo_check", 1) < 2]
    checked = {r["name"] for r in rows} - {r["name"] for r in unchecked}
    body = [[r["name"], f"{r['K']} x {r['N']}", str(r["count"]),
             _num(r["bf16"].get("fwd_bwd_ms"), ".3f"), _num(r["fp8"].get("fwd_bwd_ms"), ".3f"),
             _ratio(r["bf16"].get("fwd_bwd_ms"), r["fp8"].get("fwd_bwd_ms")),
             _num(r.get("share_bf16_pct"), ".1f"),
             (f"{r['fp8'].get('f8_dots', '?')}/{r['fp8'].get('dots', '?')}"
              if r["name"] in checked else "n/c")
             + ("" if r.get("fp8_in_model", True) else " (bf16 in the model)")] for r in rows]
    t = record.get("totals") or {}
    parts = [f"## {TITLES['fp8_dense']}", _source_line(record, path), "",
             md_table(["matmul", "K x N", "per step", "bf16 fwd+bwd ms", "FP8 fwd+bwd ms",
                       "FP8 speed-up", "share of bf16 time %", "FP8 dots"], body)
             if body else "_no rows in the record_"]
    if t:
        parts += ["", f"Per step: bf16 {_num(t.get('step_ms_bf16'), '.2f')} ms, FP8 as configured "
                      f"{_num(t.get('step_ms_fp8_as_configured'), '.2f')} ms "
                      f"({_ratio(t.get('step_ms_bf16'), t.get('step_ms_fp8_as_configured'))}), every "
                      f"matmul in FP8 {_num(t.get('step_ms_fp8_all'), '.2f')} ms "
                      f"({_ratio(t.get('step_ms_bf16'), t.get('step_ms_fp8_all'))}); times by "
                      f"{t.get('time_source', '?')}."]
    if unchecked:
        errs = sorted({f"{r['fp8']['rel_err_y']:.1e}" for r in unchecked
                       if "rel_err_y" in r["fp8"]}, key=float)
        f8 = all(r["fp8"].get("f8e4m3") and r["fp8"].get("f8e5m2") for r in unchecked)
        parts += ["", "n/c: FP8 dots not checked. This record's HLO parser (before `hlo_check` 2) "
                      "could not see operand types on the GPU, where a GEMM custom-call names its "
                      "operands without types, so it counted 0. The FP8 evidence for these rows: "
                      + ("E4M3 and E5M2 in every row's HLO" if f8 else
                         "E4M3 or E5M2 missing from some rows' HLO")
                      + (", and the FP8 output's relative error against bf16, "
                         + " to ".join(dict.fromkeys((errs[0], errs[-1]))) if errs else "") + "."]
    return "\n".join(parts)
