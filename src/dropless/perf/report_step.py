"""The training-step section of ``benchmarks/RESULTS.md`` (``benchmarks/step.py``'s records).

A step record compares ours with the baselines, FP8 variants of ours with ``ours``,
other (unquantized) variants of ours with ``ours``, or is a single run;
``step_variant`` says which, and each renders as its own subsection of
``step_section``. Record fields: see ``report``'s docstring.
"""

import os
from pathlib import Path

from dropless.perf.report_md import (TITLES, _get, _num, _plt, _ratio, _save, _source_line,
                                     fp8_impl_text, md_table)

STEP_BASELINES = ("xla", "capacity")  # benchmarks/step.py's baseline cases
QUANTIZATION_KEYS = ("quantization", "te_gmm_quantization", "gmm_quantization")
UNQUANTIZED = ("", "te_no_quant")  # the values of those keys that quantize nothing


def step_rows(record: dict) -> list[dict]:
    """Normalised step rows: name, role, tflops, and the optional extras."""
    rows = []
    # What the whole run was given beyond its cases (step.py --set), and whether it ended
    # early: every row of such a run says so, as it is not the plain case.
    context = " ".join([*(f"`{o}`" for o in record.get("extra_overrides") or []),
                        *(["(partial run)"] if record.get("partial") else [])])
    for r in record.get("rows") or record.get("results") or record.get("cases") or []:
        if not isinstance(r, dict):
            continue
        name = str(_get(r, "name", "case", "variant", default="?"))
        role = _get(r, "role") or ("ours" if "ours" in name.lower() else "baseline")
        cfg = r.get("config") if isinstance(r.get("config"), dict) else {}
        model = cfg.get("model_name") or next(
            (o.partition("=")[2] for o in r.get("overrides") or [] if o.startswith("model_name=")),
            None)
        rows.append({"name": name, "role": role, "explicit_role": "role" in r,
                     "tflops": _get(r, "tflops_per_device", "tflops"),
                     "tokens_per_s": _get(r, "tokens_per_s", "tokens_per_second"),
                     "step_ms": _get(r, "step_ms", "step_time_ms")
                     or (r["step_time_s"] * 1e3 if r.get("step_time_s") else None),
                     "memory": _get(r, "peak_memory_gib", "peak_mem_gib", "peak_memory_gb"),
                     "batch": _get(r, "per_device_batch_size", "batch"),
                     "model": model, "fp8_impl": r.get("gmm_fp8_impl_resolved"),
                     "note": "; ".join(filter(None, [_get(r, "note", "error", default="") or context,
                                                    _clock_note(r.get("gpu_clocks"))]))})
    return rows


def _clock_note(clocks) -> str:
    """The timed steps' median SM clock and power (``perf.clocks``), where the record has them:
    a sustained step runs at the power limit, below the clock short kernel timings see."""
    if not isinstance(clocks, dict) or not clocks.get("available") or not clocks.get("sm_mhz_median"):
        return ""
    power = clocks.get("power_w_median")
    return f"SM {clocks['sm_mhz_median']:,.0f} MHz" + (f", {power:,.0f} W" if power else "")


def step_variant(record: dict) -> str:
    """What a step record compares, from its cases that have a TFLOPS result:
    "baselines" (``xla`` and ``capacity`` cases, or a row with role baseline; "baselines
    xla" or "baselines capacity" where the run has only that one),
    "fp8" (``ours`` and ``ours_*`` cases: FP8 and other variants of ours in one run),
    "variants" (the same, where ``case_overrides`` shows that no ``ours_*`` case, failed
    ones included, sets a quantization key: ``scan_layers=true`` against ``ours``, say),
    else "models" (``ours`` alone, another model such as ``qwen3-moe-proxy``, ...).
    A run with ``--set`` overrides on every case is its own variant, "fp8 <overrides>"
    or "variants <overrides>"."""
    rows = [r for r in step_rows(record) if r["tflops"]]
    names = {r["name"] for r in rows}
    present = sorted(names & set(STEP_BASELINES))
    if present or any(r["explicit_role"] and r["role"] == "baseline" for r in rows):
        # A run of one baseline (the xla case needs batch 1, say) is its own variant, so
        # the newest run of the other does not hide it.
        return "baselines" + (f" {present[0]}" if len(present) == 1 else "")
    if "ours" in names and any(n.startswith("ours_") for n in names):
        overrides = record.get("case_overrides") or {}
        variants = {r["name"] for r in step_rows(record) if r["name"].startswith("ours_")}
        # A case missing from case_overrides may quantize: such records stay "fp8".
        plain = all(n in overrides and not _quantizes(overrides[n]) for n in variants)
        extra = record.get("extra_overrides") or []
        return ("variants" if plain else "fp8") + (" " + " ".join(extra) if extra else "")
    return "models"


def _quantizes(overrides: list[str]) -> bool:
    """Whether ``key=value`` overrides set a quantization key to a recipe."""
    return any(key in QUANTIZATION_KEYS and value not in UNQUANTIZED
               for key, _, value in (o.partition("=") for o in overrides))


def _cell(text, width: int = 80) -> str:
    """One table cell from free text: whitespace collapsed, pipes escaped, cut to ``width``."""
    text = " ".join(str(text).split())[:width]
    return text.replace("|", "\\|") or "-"


def step_section(variants: dict, fig_dir: Path, md_dir: Path, models=None) -> str:
    """Markdown for the training-step benchmark: each kind of record present, in turn.

    Args:
      variants: ``step_variant`` -> (record, path) of the newest record of each.
      models: (record, path, created) of every "models" record; the table shows the
        newest row of each case over all of them (default: the newest record alone).
    """
    if models is None and "models" in variants:
        models = [(*variants["models"], 0)]
    parts = [f"## {TITLES['step']}"]
    for name in sorted(v for v in variants if v.split(" ")[0] == "baselines"):
        parts += ["", _step_baselines(*variants[name], fig_dir, md_dir, name)]
    for kind, title in (("fp8", "FP8 and other variants of ours"),
                        ("variants", "Other variants of ours (same run)")):
        for name in sorted(v for v in variants if v.split(" ")[0] == kind):
            parts += ["", _step_ours_variants(*variants[name], title)]
    if models:
        parts += ["", _step_models(models)]
    return "\n".join(parts)


def _step_baselines(record: dict, path: Path, fig_dir: Path, md_dir: Path,
                    variant: str = "baselines") -> str:
    """Ours against the baselines of one run: TFLOPS/device and the ratio to the best;
    ``variant`` (``step_variant``'s) names its figure."""
    rows = step_rows(record)
    baselines = [r["tflops"] for r in rows if r["role"] != "ours" and r["tflops"]]
    best = max(baselines, default=None)
    body = [[r["name"], r["role"], _num(r["tflops"]), _ratio(r["tflops"], best),
             _num(r["tokens_per_s"], ",.0f"), _num(r["step_ms"], ".1f"), _num(r["memory"], ".1f"),
             _num(r["batch"], "g"), _cell(r["note"])] for r in rows]
    names = ", ".join(r["name"] for r in rows if r["role"] != "ours")
    parts = [f"### Ours against the baselines ({names or 'none'})", _source_line(record, path), ""]
    cfg = record.get("config") or {}
    if cfg:
        parts += ["Config: " + ", ".join(f"`{k}={v}`" for k, v in cfg.items()
                                          if not isinstance(v, (dict, list)))[:600], ""]
    if rows:
        stem = "_".join(["step_tflops", *variant.split(" ")[1:]])
        fig = _step_plot(rows, best, fig_dir / f"{stem}.png")
        parts += [f"![training step TFLOPS/device]({os.path.relpath(fig, md_dir)})", ""]
    parts.append(md_table(["variant", "role", "TFLOPS/device", "vs best baseline", "tokens/s",
                           "step ms", "peak memory GiB", "batch/device", "note"], body, labels=2)
                 if body else "_no rows in the record_")
    return "\n".join(parts)


def _step_ours_variants(record: dict, path: Path, title: str) -> str:
    """Variants of ours (FP8 recipes, or others) from one run, each against that run's
    ``ours``, under the heading ``title``."""
    rows = step_rows(record)
    ours = next((r["tflops"] for r in rows if r["name"] == "ours"), None)
    overrides = record.get("case_overrides") or {}
    base = set(overrides.get("ours") or [])
    body = [[r["name"], fp8_impl_text(r["fp8_impl"]),
             _cell(" ".join(f"`{o}`" for o in overrides.get(r["name"]) or [] if o not in base),
                   400) if r["name"] != "ours" else "-",
             _num(r["tflops"]), _ratio(r["tflops"], ours), _num(r["tokens_per_s"], ",.0f"),
             _num(r["step_ms"], ".1f"), _num(r["memory"], ".1f"), _num(r["batch"], "g"),
             _cell(r["note"])] for r in rows]
    extra = record.get("extra_overrides") or []
    heading = f"### {title}" + (
        ", every case with " + " ".join(f"`{o}`" for o in extra) if extra else "")
    return "\n".join([
        heading, _source_line(record, path), "",
        "Each case against `ours` of the same run; overrides are the case's beyond `ours`'s, "
        "FP8 impl the grouped GEMMs' resolved `gmm_fp8_impl`.", "",
        md_table(["case", "FP8 impl", "overrides", "TFLOPS/device", "vs ours (same run)",
                  "tokens/s", "step ms", "peak memory GiB", "batch/device", "note"], body,
                 labels=3) if body else "_no rows in the record_"])


def _step_models(models: list) -> str:
    """The newest row of each case over the records of single runs; no ratios."""
    newest = {}
    for record, path, when in sorted(models, key=lambda m: m[2]):
        for r in step_rows(record):
            # A failed rerun does not hide an earlier result.
            earlier = newest.get(r["name"])
            if r["tflops"] or earlier is None or not earlier[0]["tflops"]:
                newest[r["name"]] = (r, record, path)
    body = [[r["name"], r["model"] or "-", f"`{path.name}`", _num(r["tflops"]),
             _num(r["tokens_per_s"], ",.0f"), _num(r["step_ms"], ".1f"), _num(r["memory"], ".1f"),
             _num(r["batch"], "g"), _cell(r["note"])] for r, _, path in newest.values()]
    sources = {path: record for _, record, path in newest.values()}
    return "\n".join([
        "### Other models and single runs",
        *[f"- {_source_line(record, path)}" for path, record in sources.items()], "",
        "The newest row of each case; the rows come from different runs (or models), so no "
        "ratios: ratios are only given within one run.", "",
        md_table(["case", "model", "source", "TFLOPS/device", "tokens/s", "step ms",
                  "peak memory GiB", "batch/device", "note"], body, labels=3)
        if body else "_no rows in the records_"])


def _step_plot(rows, best, out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.5), dpi=110)
    names = [r["name"] for r in rows][::-1]
    vals = [r["tflops"] or 0.0 for r in rows][::-1]
    colors = ["#2ca02c" if r["role"] == "ours" else "#7f7f7f" for r in rows][::-1]
    ax.barh(names, vals, color=colors)
    for y, (v, r) in enumerate(zip(vals, rows[::-1])):
        label = f"{v:.0f}" + (f" ({v / best:.1f}x)" if best and r["role"] == "ours" else "")
        ax.text(v, y, " " + label, va="center", fontsize=8)
    ax.set_xlabel("TFLOPS/device (model FLOPs, MaxText convention)")
    ax.set_xlim(0, max(vals + [1.0]) * 1.25)
    ax.set_title("Training step throughput: baselines (grey) vs ours (green)", fontsize=10)
    return _save(fig, out)


def step_headline(variant: str, record: dict) -> list[str]:
    """Baselines: ours against the best baseline; fp8 and variants: each ``ours_*`` case
    against the same run's ``ours``; models: none (rows of different runs)."""
    rows = step_rows(record)
    if variant.split(" ")[0] == "baselines":
        date = str(record.get("time") or record.get("created") or "")[:10]
        when = f" of {date}" if date else ""
        best = max((r for r in rows if r["role"] != "ours" and r["tflops"]),
                   key=lambda r: r["tflops"], default=None)
        return [f"training step: {r['name']} {r['tflops']:.0f} TFLOPS/device"
                + (f" = {r['tflops'] / best['tflops']:.1f}x the best baseline ({best['name']}, "
                   f"batch {_num(best['batch'], 'g')}, same run{when})" if best else "")
                for r in rows if r["role"] == "ours" and r["tflops"]]
    if variant.split(" ")[0] in ("fp8", "variants"):
        ours = next((r["tflops"] for r in rows if r["name"] == "ours"), None)
        extra = variant.partition(" ")[2]
        where = f" ({extra})" if extra else ""
        return [f"training step{where}, variant {r['name']} {r['tflops']:.0f} TFLOPS/device = "
                f"{r['tflops'] / ours:.2f}x ours (same run)"
                for r in rows if r["name"].startswith("ours_") and r["tflops"] and ours]
    return []
