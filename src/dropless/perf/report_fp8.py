"""The FP8 sections of ``benchmarks/RESULTS.md``: the grouped GEMM kernels alone
(``benchmarks/fp8_kernel_probe.py``: the newest run of all products, of a wgrad variant
sweep and of a ``--sustain`` run, each per shape and layout, ``fp8_kernels_variant``), the
quantization passes and the kernel path's
products (``benchmarks/fp8_quant.py``), and the dense matmuls in bf16 against FP8
(``benchmarks/fp8_dense.py``).
"""

from pathlib import Path

from dropless.perf.report_md import TITLES, _num, _ratio, _source_line, md_table

FP8_TARGETS = {"fwd": 1250.0, "dgrad": 1250.0, "wgrad": 1100.0}  # TF/s, kernels alone (issue 12)
# The probe's names for what training runs by default, ``quantized.KERNEL_SCHEDULES``'s
# ``default`` (``wide_o192_n160`` since 2026-12-06): gmm_fp8_blockwise split rows, grid
# tile width 8, 4 stages, 128x192 CTA tiles (``block_o=192``); tgmm_fp8_blockwise split
# rows, the plain step on 128x160 CTA tiles (``overlap=False, block_n=160``), in the
# sorted_snake tile order, its tiles chained; the probe's float32 output; training writes
# the layer's dtype, the ``_bf16`` rows.
DEFAULT_VARIANTS = {"fwd": "rows_gtw8_o192", "dgrad": "rows_gtw8_o192",
                    "wgrad": "wgrad_rows_n160_sorted_chain"}
# The ``narrow`` schedule's (the kernels' own default arguments; training's default
# until 2026-12-06): 128x128 CTA tiles, the wgrad's step overlapped with the next
# wgmma. Quoted, and said so, where a record did not time the default (older records).
NARROW_VARIANTS = {"fwd": "rows_gtw8", "dgrad": "rows_gtw8",
                   "wgrad": "wgrad_rows_overlap_sorted_chain"}


def _default_row(timed: list[dict], product: str, suffix: str = ""):
    """(row, note) of ``product``'s default variant among ``timed`` (``suffix``: "_bf16"
    for the bf16-output rows), else of its ``narrow`` one with a note saying so; (None,
    "") where neither was timed."""
    for names, note in ((DEFAULT_VARIANTS, ""),
                        (NARROW_VARIANTS, "narrow schedule")):
        row = next((r for r in timed if r["variant"] == names[product] + suffix), None)
        if row:
            return row, note
    return None, ""


# The probe's default shape: a sweep at another shape or layout is its own variant, so a
# Qwen3 or skewed sweep does not replace the DeepSeek one.
DEEPSEEK_SWEEP_SHAPE = (65536, 32, 7168, 4096)


def _reached(value, target) -> str:
    """A throughput against its target (higher is better)."""
    if value is None or target is None:
        return "-"
    return f"{target:.0f}: " + ("met" if value >= target else "**not met**")


def fp8_kernel_rows(record: dict) -> list[dict]:
    """Timed rows of an ``fp8_kernels`` record (``benchmarks/fp8_kernel_probe.py``) from
    short runs: a ``--sustain`` run's second timing of each job (``"sustained"``, after
    the back-to-back run) is not what the targets are quoted against."""
    return [r for r in record.get("rows", []) if r.get("tflops_kernel") and not r.get("sustained")]


def fp8_kernels_variant(record: dict) -> str:
    """What an ``fp8_kernels`` record times: "sustained" when it has ``--sustain`` rows
    (each job timed again after running back to back), else "wgrad sweep" when its rows
    are all wgrad variants (the probe run with ``--variants=``), else "products" (fwd and
    dgrad, with wgrad unless ``--wgrad-variants=``). A sustained run or a sweep at
    another shape or layout than the probe's default names it."""
    rows = record.get("rows", [])
    if any(r.get("sustained") for r in rows):
        return "sustained" + _shape_suffix(record)
    if {r.get("product") for r in rows} != {"wgrad"}:
        return "products" + _shape_suffix(record)
    return "wgrad sweep" + _shape_suffix(record)


def _shape(record: dict) -> tuple:
    """The record's (M, G, K, N), None where its config lacks one."""
    cfg = record.get("config") or {}
    return tuple(cfg.get(k) for k in ("M", "G", "K", "N"))


def _at_target_shape(record: dict) -> bool:
    """Whether the issue's kernel targets (``FP8_TARGETS``) are set at the record's shape:
    M=65536, G=32 or 256, DeepSeek-V3's K=7168 N=4096 or K=2048 N=7168 (or no shape given)."""
    shape = _shape(record)
    return shape == (None,) * 4 or (shape[0] == 65536 and shape[1] in (32, 256)
                                    and shape[2:] in ((7168, 4096), (2048, 7168)))


def _shape_suffix(record: dict) -> str:
    """"" at the probe's default shape and layout, else " M=.. G=.. K=.. N=.. layout"."""
    shape = _shape(record)
    layout = (record.get("config") or {}).get("layout", "balanced")
    if shape in (DEEPSEEK_SWEEP_SHAPE, (None,) * 4) and layout == "balanced":
        return ""
    return " " + " ".join(f"{k}={v}" for k, v in zip("MGKN", shape)) + f" {layout}"


def sustained_pairs(record: dict) -> list[tuple[dict, dict]]:
    """(short-run row, sustained row) of each job a ``--sustain`` record timed twice."""
    short = {(r["variant"], r["product"]): r for r in fp8_kernel_rows(record)}
    return [(short[key], r) for r in record.get("rows", [])
            if r.get("sustained") and r.get("tflops_kernel")
            and (key := (r["variant"], r["product"])) in short]


def _mhz(row: dict):
    """The median SM clock NVML sampled while the row was timed, if it was."""
    return (row.get("gpu_clocks") or {}).get("sm_mhz_median")


def fp8_kernels_headline(variant: str, record: dict) -> list[str]:
    """Each product's kernel TF/s against its target, the variant quoted named.

    products: the default variant of each product (``DEFAULT_VARIANTS``), or where the
    record lacks it the best one, said so. wgrad sweep: the default and the sweep's best,
    each named.
    """
    rows = fp8_kernel_rows(record)
    if variant.startswith("sustained"):
        pairs = sustained_pairs(record)
        chosen = {p: _default_row([a for a, _ in pairs if a["product"] == p], p)
                  for p in DEFAULT_VARIANTS}
        pairs = [(a, b) for a, b in pairs if a is chosen[a["product"]][0]]
        if not pairs:
            return []
        which = ("the narrow schedule's variants" if any(chosen[a["product"]][1] for a, _ in pairs)
                 else "default variants")
        seconds = (record.get("config") or {}).get("sustain_s")
        after = f"after {seconds:g} s back to back" if seconds else "run back to back"
        return [f"FP8 kernels under load{variant.removeprefix('sustained')} (CUPTI, {which}, "
                f"{after}): " + ", ".join(
                    f"{a['product']} {b['tflops_kernel']:.0f} TF/s"
                    + (f" at {_mhz(b):.0f} MHz" if _mhz(b) else "")
                    + f", {_ratio(b['tflops_kernel'], a['tflops_kernel'])} its short run's "
                    f"{a['tflops_kernel']:.0f}" + (f" at {_mhz(a):.0f} MHz" if _mhz(a) else "")
                    for a, b in pairs)]
    if variant.startswith("wgrad sweep"):
        timed = [r for r in rows if r["product"] == "wgrad"]
        if not timed:
            return []
        best = max(timed, key=lambda r: r["tflops_kernel"])
        default, narrow = _default_row(timed, "wgrad")
        trained, _ = _default_row(timed, "wgrad", "_bf16")
        best = None if best in (default, trained) else best  # named once
        first = "narrow" if narrow else "default"  # a record older than the default
        quoted = [(which, r) for which, r in ((first, default), ("bf16 output, as trained",
                                                                   trained), ("best", best))
                  if r]
        # The target is the issue's, at its shapes (``_at_target_shape``): others quoted bare.
        at = variant.removeprefix("wgrad sweep")
        target = f" (target {FP8_TARGETS['wgrad']:.0f})" if _at_target_shape(record) else ""
        return [f"FP8 wgrad variant sweep{at} (CUPTI): " + ", ".join(
            f"{which} {r['variant']} {r['tflops_kernel']:.0f} TF/s" for which, r in quoted) + target]
    quoted = []
    targets = _at_target_shape(record)
    for product, name in DEFAULT_VARIANTS.items():
        timed = [r for r in rows if r["product"] == product]
        if not timed:
            continue
        row, why = _default_row(timed, product)
        why = why if row else f"the best timed, the default {name} was not"
        row = row or max(timed, key=lambda r: r["tflops_kernel"])
        notes = [f"target {FP8_TARGETS[product]:.0f}"] if targets else []
        notes += [why] if why else []
        quoted.append(f"{product} {row['variant']} {row['tflops_kernel']:.0f} TF/s"
                      + (f" ({'; '.join(notes)})" if notes else ""))
    at = _shape_suffix(record)
    return ([f"FP8 kernels alone{at} (CUPTI, default variants): " + ", ".join(quoted)]
            if quoted else [])


def fp8_kernels_section(variants: dict, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the FP8 kernels alone: the newest record timing the products at the
    probe's default shape (each variant against the targets), then at each other shape
    and layout, the newest sustained run of each, and the newest wgrad variant sweep of
    each.

    Args:
      variants: ``fp8_kernels_variant`` -> (record, path).
    """
    parts = [f"## {TITLES['fp8_kernels']}"]
    if "products" in variants:
        parts += [_source_line(*variants["products"]), ""]
    parts += ["Default variants (training's default kernel schedule, `wide_o192_n160`): "
              + ", ".join(f"{p} `{v}`" for p, v in DEFAULT_VARIANTS.items())
              + "; the `narrow` schedule's (the default before 2026-12-06, quoted where a "
              "record lacks the default's): "
              + ", ".join(f"{p} `{v}`" for p, v in NARROW_VARIANTS.items())
              + "; training writes wgrad in the layer's dtype, so in bf16 it runs "
              f"`{DEFAULT_VARIANTS['wgrad']}_bf16`. Targets (issue 12) are set at M=65536, "
              "G=32 and 256, K=7168 N=4096 and K=2048 N=7168."]
    if "products" in variants:
        parts += ["", _fp8_kernel_table(variants["products"][0])]
    for name in sorted(v for v in variants if v.startswith("products ")):
        record = variants[name][0]
        parts += ["", "### Products" + name.removeprefix("products"),
                  _source_line(*variants[name]), "",
                  _fp8_kernel_table(record, targets=_at_target_shape(record))]
    for name in sorted(v for v in variants if v.startswith("sustained")):
        record = variants[name][0]
        seconds = (record.get("config") or {}).get("sustain_s")
        body = [[a["variant"], a["product"], _num(a["tflops_kernel"], ".0f"), _num(_mhz(a), ".0f"),
                 _num(b["tflops_kernel"], ".0f"), _num(_mhz(b), ".0f"),
                 _ratio(b["tflops_kernel"], a["tflops_kernel"])]
                for a, b in sustained_pairs(record)]
        parts += ["", "### Under load" + name.removeprefix("sustained"),
                  _source_line(*variants[name]), "",
                  "`benchmarks/fp8_kernel_probe.py --sustain SECONDS`: each kernel timed in a "
                  "short run, then again after running back to back for "
                  + (f"{seconds:g} s" if seconds else "a while")
                  + " (where a training step runs, at the board's power limit); the SM clock "
                  "is NVML's median over each timing.", "",
                  md_table(["variant", "product", "short TF/s", "short MHz", "loaded TF/s",
                            "loaded MHz", "loaded / short"], body, labels=2)
                  if body else "_no sustained rows in the record_"]
    for name in sorted(v for v in variants if v.startswith("wgrad sweep")):
        title = "wgrad variant sweep" + name.removeprefix("wgrad sweep")
        parts += ["", f"### {title}", _source_line(*variants[name]), "",
                  "`benchmarks/fp8_kernel_probe.py --variants=`: the wgrad kernel's variants "
                  "alone, each with float32 output and with bf16 (`_bf16`); "
                  f"`{DEFAULT_VARIANTS['wgrad']}` is the default, "
                  f"`{NARROW_VARIANTS['wgrad']}` the `narrow` schedule's.", "",
                  _fp8_kernel_table(variants[name][0],
                                    targets=_at_target_shape(variants[name][0]))]
    return "\n".join(parts)


def _fp8_kernel_table(record: dict, targets: bool = True) -> str:
    """A record's shape, its rows against the targets (``targets``: the issue's, set at
    DeepSeek-V3's shapes), and its bit-for-bit checks."""
    cfg = record.get("config") or {}
    body = [[r["variant"], r["product"], _num(r["kernel_ms"], ".3f"), _num(r["wall_ms"], ".3f"),
             _num(r["tflops_kernel"], ".0f"), _num(r["tflops_wall"], ".0f"),
             _reached(r["tflops_kernel"], FP8_TARGETS.get(r["product"]) if targets else None)]
            for r in fp8_kernel_rows(record)]
    checks = [f"{r['product']} {r['variant']} == {r['bitwise_equal_to']}: {r['equal']}"
              for r in record.get("rows", []) if "bitwise_equal_to" in r]
    parts = ["Shape: " + ", ".join(f"`{k}={cfg[k]}`" for k in ("M", "G", "K", "N", "layout")
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
    default quantizers (``auto``) when the record has them, else the Pallas ones (the
    default before 2026-12-03), else XLA's; the others beside it."""
    by = {r["name"]: r for r in record.get("rows", []) if r.get("section") == "product"}
    auto, pallas, xla, alone, bf16 = (by.get(n, {}).get("kernel_ms") for n in (
        "fwd+bwd kernel path, auto q", "fwd+bwd kernel path, pallas q", "fwd+bwd kernel path",
        "fwd+bwd FP8 kernels alone", "fwd+bwd bf16 kernel"))
    path, which = next(((t, w) for t, w in ((auto, " (default quantizers)"),
                                            (pallas, " (Pallas quantizers)"), (xla, ""))
                        if t), (None, ""))
    if not (path and bf16):
        return []
    line = (f"FP8 fwd+dgrad+wgrad with quantization{which} {path:.1f} ms = "
            f"{bf16 / path:.2f}x bf16's {bf16:.1f} ms")
    extras = [f"Pallas quantizers {pallas:.1f} ms = {bf16 / pallas:.2f}x"] if auto and pallas else []
    extras += [f"XLA's quantization {xla:.1f} ms = {bf16 / xla:.2f}x"] if xla and path != xla else []
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
