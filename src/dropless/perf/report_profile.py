"""The step-profile section of ``benchmarks/RESULTS.md``: kernel time by category, the
newest bf16 and FP8 profiles (``dropless profile --out``) side by side.
"""

import os
from pathlib import Path

from dropless.perf.report_md import (TITLES, _num, _plt, _save, _source_line, fp8_impl_text,
                                     md_table, provenance)


def profile_precision(record: dict) -> str:
    """The precision of a profile record, bf16 or fp8: its ``config.precision``, else
    derived from its quantization keys."""
    cfg = record.get("config") or {}
    if cfg.get("precision") in ("bf16", "fp8"):
        return cfg["precision"]
    quantized = cfg.get("quantization") or cfg.get("te_gmm_quantization") not in (
        None, "", "te_no_quant")
    return "fp8" if quantized else "bf16"


def _profile_rows(record: dict) -> dict:
    """category -> row of a profile record, in ``breakdown.CATEGORIES`` order first."""
    from dropless.perf.breakdown import CATEGORIES

    rows = {r["category"]: r for r in record.get("rows", []) if "category" in r}
    order = [c for c in CATEGORIES if c in rows] + [c for c in rows if c not in CATEGORIES]
    return {c: rows[c] for c in order}


def _profile_facts(record: dict) -> str:
    cfg = dict(record.get("config") or {})
    if cfg.get("te_gmm_quantization") in (None, "te_no_quant"):  # the FP8 keys change nothing
        cfg.pop("gmm_fp8_impl", None)
    elif isinstance(ran := cfg.get("gmm_fp8_impl_resolved"), dict):  # what "auto" ran as
        cfg["gmm_fp8_impl"] = f"{cfg.get('gmm_fp8_impl')} (ran: {fp8_impl_text(ran)})"
    keys = ("model_name", "quantization", "te_gmm_quantization", "gmm_fp8_impl", "remat_policy",
            "attention", "per_device_batch_size", "max_target_length")
    return ", ".join(f"`{k}={cfg[k]}`" for k in keys if k in cfg and cfg[k] not in (None, ""))


def profile_section(variants: dict, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the newest bf16 and FP8 profiles: a table of categories and a stacked bar.

    Args:
      variants: precision ("bf16" / "fp8") -> (record, path); either may be missing.
    """
    names = [v for v in ("bf16", "fp8") if v in variants]
    names += sorted(set(variants) - set(names))
    parts = [f"## {TITLES['profile']}", ""]
    for v in names:
        record, path = variants[v]
        parts.append(f"- **{v}**: {_profile_facts(record)}. {_source_line(record, path)}")
    missing = [v for v in ("bf16", "fp8") if v not in variants]
    if missing:
        parts.append(f"- {', '.join(missing)}: _no profile yet_")
    commits = {v: str(provenance(variants[v][0])["commit"])[:7] for v in names}
    if len(set(commits.values())) > 1:
        # Loans differ by several percent in step time: across runs, no ratio.
        parts.append("- _Not one run_ (" + ", ".join(f"{v} at `{c}`" for v, c in commits.items())
                     + "): the step times are not a same-run ratio; the Training step section's are.")
    parts += ["", "Kernel time per step and device by category (`dropless profile`, "
              "jax.profiler trace); % of summed kernel time and of the step's wall time.", ""]
    rows = {v: _profile_rows(variants[v][0]) for v in names}
    cats = list(dict.fromkeys(c for v in names for c in rows[v]))
    headers = ["category"] + [f"{v} {col}" for v in names for col in ("ms/step", "% kernel",
                                                                      "% wall")]
    body = []
    for c in cats:
        label = next(rows[v][c].get("label", c) for v in names if c in rows[v])
        cells = [label]
        for v in names:
            r = rows[v].get(c, {})
            cells += [_num(r.get("ms_per_step"), ".2f"), _num(r.get("pct_kernel")),
                      _num(r.get("pct_wall"))]
        body.append(cells)
    for label, key, spec in (("kernel total", "kernel_ms_per_step", ".2f"),
                             ("step (wall)", "step_ms", ".2f"),
                             ("TFLOPS/device", "tflops_per_device", ".0f")):
        body.append([f"**{label}**"] + [c for v in names for c in (
            _num(variants[v][0].get(key), spec), "-", "-")])
    if names:
        fig = _profile_plot({v: variants[v][0] for v in names}, fig_dir / "profile_categories.png")
        parts += [f"![kernel time by category]({os.path.relpath(fig, md_dir)})", ""]
    parts.append(md_table(headers, body) if cats else "_no rows in the records_")
    return "\n".join(parts)


def _profile_plot(records: dict, out: Path) -> Path:
    """One stacked horizontal bar per precision: ms/step by category, then the untimed gap
    (step wall time not covered by kernel time) hatched."""
    from dropless.perf.breakdown import COLORS

    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(records) + 1.8), dpi=110)
    seen = set()
    for y, (name, record) in enumerate(reversed(list(records.items()))):
        left = 0.0
        for c, r in _profile_rows(record).items():
            ms = r.get("ms_per_step") or 0.0
            label = r.get("label", c)
            ax.barh(y, ms, left=left, color=COLORS.get(c, "#888"),
                    label=None if label in seen else label)
            seen.add(label)
            left += ms
        step = record.get("step_ms")
        if step and step > left:
            ax.barh(y, step - left, left=left, color="white", edgecolor="0.5", hatch="//",
                    label=None if "no kernel" in seen else "no kernel (gaps)")
            seen.add("no kernel")
        total = max(left, step or 0.0)
        tf = record.get("tflops_per_device")
        ax.text(total, y, f" {total:.0f} ms" + (f", {tf:.0f} TFLOPS" if tf else ""),
                va="center", fontsize=8)
    ax.set_yticks(range(len(records)), list(reversed(list(records))))
    ax.set_xlabel("ms per step per device")
    right = max((max(r.get("step_ms") or 0.0, r.get("kernel_ms_per_step") or 0.0)
                 for r in records.values()), default=1.0)
    ax.set_xlim(0, 1.3 * right if right > 0 else 1.0)
    ax.set_title("Training step: kernel time by category", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return _save(fig, out)


def profile_headline(name: str, record: dict) -> list[str]:
    rows = [r for r in _profile_rows(record).values() if (r.get("pct_kernel") or 0) >= 0.5]
    if not rows or not record.get("step_ms"):
        return []
    cats = ", ".join(f"{r.get('label', r['category'])} {r['pct_kernel']:.0f}%"
                     for r in sorted(rows, key=lambda r: -r["pct_kernel"]))
    tf = record.get("tflops_per_device")
    return [f"step profile ({name}): {record['step_ms']:.0f} ms/step"
            + (f", {tf:.0f} TFLOPS/device" if tf else "") + f"; kernel time: {cats}"]
