"""Render ``benchmarks/RESULTS.md`` and its plots from the newest results files.

    python -m dropless.perf.report [--results benchmarks/results] [--md benchmarks/RESULTS.md]

Reads every ``*.json`` under the results directory: single records (``kind``
gmm / moe_layer / step, see ``perf.measure``) and ``dropless bench`` bundles
(``kind: bench`` holding one record per benchmark), and keeps the newest
record of each kind by its ``created`` time. So results from separate runs
render together, and a rerun of one benchmark replaces only its section.

Every number on the page comes from a record that names its GPU, jax version
and commit; records without them (or with commit "unknown") are skipped, with
the reason printed. Each section cites its file.

Record fields read (aliases accepted, so the benchmarks' own formats work):

- **gmm** (``benchmarks/gmm.py``): ``results``: one row per (M, G, K, N,
  layout) with ``tflops[impl][op]``; impls ``ours``, ``dense`` (cuBLAS at
  equal FLOPs: the ceiling), ``torch`` (``torch._grouped_mm``), ``jaxex``,
  ``ragged``; ops ``fwd``, ``dgrad``, ``wgrad``, ``fwd+dgrad+wgrad``. Flat rows
  ``{shape, layout, op, impl, tflops}`` are accepted too.
- **moe_layer** (``benchmarks/moe_layer.py``): ``rows`` per case with
  ``fwd_ms``, ``fwd_bwd_ms``, ``*_tflops``, ``dropped_fraction`` (or ``error``, or
  ``skipped``: why a case that cannot fit the device was not run); ``split``
  with per-piece times; ``targets``.
- **profile** (``dropless profile --out``): ``config`` with ``precision``
  ("bf16" | "fp8"; derived from ``quantization`` / ``te_gmm_quantization``
  when absent), ``rows`` per kernel category (``category``, ``label``,
  ``ms_per_step``, ``pct_kernel``, ``pct_wall``), ``step_ms``,
  ``kernel_ms_per_step``, ``tflops_per_device``. The newest record of each
  precision is kept (keys ``profile:bf16``, ``profile:fp8``) and the two
  render side by side.
- **step** (``benchmarks/step.py``): ``rows`` (or ``results``/``cases``), one per
  variant: ``name`` (or ``case``/``variant``), ``tflops_per_device`` (or
  ``tflops``), optional ``tokens_per_s``, ``step_ms``, ``peak_memory_gib``,
  ``per_device_batch_size``, ``note`` (or ``error``), ``gmm_fp8_impl_resolved``,
  and ``role`` ("baseline" | "ours"; without it a name containing "ours" is
  ours, the rest baselines); ``case_overrides`` per case. A record compares
  ours with the baselines, FP8 variants of ours with ``ours``, unquantized
  variants of ours with ``ours``, or is a single run (``step_variant``); the
  newest of each of the first three kinds renders, and the newest row of each
  case over all single runs.
- **fp8_kernels** (``benchmarks/fp8_kernel_probe.py``): ``rows`` of ``variant``,
  ``product`` (fwd | dgrad | wgrad), ``kernel_ms``, ``wall_ms``, ``tflops_kernel``,
  ``tflops_wall``, or a bit-for-bit check (``bitwise_equal_to``, ``equal``), and with
  ``--sustain`` a second timing of each job (``sustained``). The newest record of each
  scope renders (``fp8_kernels_variant``: the products, a wgrad variant sweep, or a
  sustained run, each per shape and layout); the headlines quote the default variants,
  against the issue's targets at its shapes only, and a sustained run's loaded rows
  beside their short runs.
- **gmm_tile_probe** (``benchmarks/gmm_tile_probe.py``): ``rows`` per (``shape``,
  ``layout``, ``product``, ``tiling``) with ``tiles``, ``overhead``, ``kernel_ms``,
  ``wall_ms``, ``tflops_kernel``, ``tflops_wall``, ``vs_dense``, ``equal`` (or
  ``skipped``/``error``); ``dense`` per shape and product. The newest record of each
  scope (shapes, layouts, products: ``gmm_tile_probe_variant``) renders as its own table.
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from dropless.perf.measure import DEFAULT_RESULTS_DIR, REPO_ROOT
from dropless.perf.report_fp8 import (fp8_dense_section, fp8_kernels_headline, fp8_kernels_section,
                                      fp8_kernels_variant, fp8_loss_headline, fp8_quant_headline,
                                      fp8_quant_section)
from dropless.perf.report_gmm_probe import (gmm_tile_probe_headline, gmm_tile_probe_section,
                                            gmm_tile_probe_variant)
from dropless.perf.report_md import (CREATED, TITLES, _get, _num, _plt, _ratio, _save,
                                     _short_commit, _source_line, md_table, provenance)
from dropless.perf.report_profile import profile_headline, profile_precision, profile_section
from dropless.perf.report_step import step_headline, step_section, step_variant

DEFAULT_MD = REPO_ROOT / "benchmarks" / "RESULTS.md"
KINDS = ("gmm", "gmm_tile_probe", "moe_layer", "step", "fp8_kernels", "fp8_quant", "profile",
         "fp8_dense", "fp8_loss")  # fp8_loss: a headline, no section


def gmm_variant(record: dict) -> str:
    """The record's shape set (``gmm.py --shape-set``); a run of some of its shapes
    (``--shapes 2``) renders as its own table, not in place of the set's whole run, and
    so does each ``--shape`` run's set of (G, K, N)."""
    name = record.get("shape_set") or "deepseek"
    selection = record.get("shape_selection")
    if name == "custom":  # ``--shape``: each shape its own table, not the newest custom run only
        shapes = sorted({(r.get("G"), r.get("K"), r.get("N")) for r in record.get("results") or []})
        return "custom-" + "-".join(f"G{g}-K{k}-N{n}" for g, k, n in shapes) if shapes else name
    return f"{name}-shapes{str(selection).replace(',', '-')}" if selection else name


# Kinds whose newest record is kept per variant (key "<kind>:<variant>"), rendered together.
VARIANTS = {"profile": profile_precision, "step": step_variant, "fp8_kernels": fp8_kernels_variant,
            "gmm": gmm_variant, "gmm_tile_probe": gmm_tile_probe_variant}
GMM_IMPLS = {"ours": "ours", "dense": "dense cuBLAS (ceiling)", "torch": "torch._grouped_mm",
             "jaxex": "jax example kernels", "ragged": "lax.ragged_dot"}
GMM_OPS = ("fwd", "dgrad", "wgrad", "fwd+dgrad+wgrad")
SPLIT_COLORS = {"router": "#d62728", "permute": "#ff7f0e", "gmm": "#1f77b4", "combine": "#9467bd",
                "shared": "#17becf", "unattributed": "#c7c7c7"}


def _created(record: dict, path: Path) -> datetime.datetime:
    text = _get(record, *CREATED)
    try:
        when = datetime.datetime.fromisoformat(str(text))
    except (TypeError, ValueError):
        when = datetime.datetime.fromtimestamp(path.stat().st_mtime)
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _records_in(path: Path):
    """(kind, record) pairs in one file: a record, or a bench bundle of records."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        yield None, {"_error": f"unreadable: {e}"}
        return
    if not isinstance(data, dict):
        yield None, {"_error": "not a JSON object"}
        return
    kind = _get(data, "kind", "benchmark") or path.name.split("-")[0]
    if kind == "bench":
        for sub_kind, sub in (data.get("records") or {}).items():
            if isinstance(sub, dict) and "error" not in sub:
                yield sub_kind, sub
        return
    yield kind, data


def newest_records(results_dir: str | os.PathLike, log=print, include_cpu: bool = False) -> dict:
    """kind -> (record, source path) of the newest valid record of each kind in ``KINDS``
    (of each "kind:variant" for the kinds in ``VARIANTS``).

    Valid: names its GPU, jax version and commit. CPU runs (smoke tests) are
    skipped unless ``include_cpu``.
    """
    return _newest(valid_records(results_dir, log, include_cpu))


def _newest(found) -> dict:
    best = {}
    for key, record, path, when in found:
        if key not in best or when > best[key][2]:
            best[key] = (record, path, when)
    return {key: (rec, path) for key, (rec, path, _) in best.items()}


def valid_records(results_dir: str | os.PathLike, log=print, include_cpu: bool = False):
    """(key, record, path, created) of every valid record (see ``newest_records``); key is
    the kind, or "kind:variant" for the kinds in ``VARIANTS``."""
    for path in sorted(Path(results_dir).glob("*.json")):
        for kind, record in _records_in(path):
            if kind not in KINDS:
                if "_error" in record:
                    log(f"skipped {path.name}: {record['_error']}")
                continue
            prov = provenance(record)
            missing = [k for k, v in prov.items() if not v or v == "unknown"]
            if missing:
                log(f"skipped {path.name} ({kind}): no {', '.join(missing)}")
                continue
            if str(prov["gpu"]).lower() == "cpu" and not include_cpu:
                log(f"skipped {path.name} ({kind}): a CPU run")
                continue
            when = _created(record, path)
            key = f"{kind}:{VARIANTS[kind](record)}" if kind in VARIANTS else kind
            yield key, record, path, when


# ----------------------------------------------------------------------------
# Grouped GEMM kernels.


def gmm_rows(record: dict) -> list[dict]:
    """Flat rows {shape, layout, op, impl, tflops} from a gmm record (nested or flat)."""
    rows = []
    for r in record.get("results") or []:
        if isinstance(r.get("tflops"), dict):
            shape = f"M={r.get('M')} G={r.get('G')} K={r.get('K')} N={r.get('N')}"
            for impl, ops in r["tflops"].items():
                for op, tf in (ops or {}).items():
                    rows.append({"shape": shape, "layout": r.get("layout", "-"), "op": op,
                                 "impl": impl, "tflops": tf})
    for r in record.get("rows") or []:
        tf = _get(r, "tflops", "tf_s")
        if isinstance(tf, (int, float)):
            rows.append({"shape": _get(r, "shape", "case", default="-"),
                         "layout": _get(r, "layout", "groups", default="-"),
                         "op": _get(r, "op", "pass", default="fwd"),
                         "impl": _get(r, "impl", "backend", "name", default="?"), "tflops": tf})
    return rows


def _pivot(rows):
    """(shape, layout, op) -> {impl: tflops}, in first-seen order."""
    table = {}
    for r in rows:
        table.setdefault((r["shape"], r["layout"], r["op"]), {})[r["impl"]] = r["tflops"]
    return table


def gmm_section(variants: dict, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the grouped GEMM benchmark: the newest record of each shape set
    (``--shape-set``; DeepSeek-V3's first), each with its table and plot.

    Args:
      variants: shape set -> (record, path).
    """
    names = sorted(variants, key=lambda v: (v != "deepseek", v))
    parts = [f"## {TITLES['gmm']}", "",
             "TF/s count real rows only (2 x rows x K x N per product, x3 for fwd+dgrad+wgrad). "
             "The dense cuBLAS matmul at equal FLOPs is the ceiling."]
    for name in names:
        parts += ["", _gmm_shape_set(name, *variants[name], fig_dir, md_dir)]
    return "\n".join(parts)


def _gmm_shape_set(name: str, record: dict, path: Path, fig_dir: Path, md_dir: Path) -> str:
    pivot = _pivot(gmm_rows(record))
    impls = [i for i in GMM_IMPLS if any(i in v for v in pivot.values())]
    impls += sorted({i for v in pivot.values() for i in v} - set(impls))
    headers = ["shape", "layout", "op", *[f"{GMM_IMPLS.get(i, i)} TF/s" for i in impls],
               "ours / dense", "ours / torch"]
    body = []
    for (shape, layout, op), v in pivot.items():
        body.append([shape, layout, op, *[_num(v.get(i)) for i in impls],
                     _ratio(v.get("ours"), v.get("dense")), _ratio(v.get("ours"), v.get("torch"))])
    parts = [f"### Shapes: {name}", _source_line(record, path), ""]
    if pivot:
        png = "gmm_tflops.png" if name == "deepseek" else f"gmm_tflops_{name}.png"
        fig = _gmm_plot(pivot, impls, fig_dir / png)
        parts += [f"![grouped GEMM TF/s, {name}]({os.path.relpath(fig, md_dir)})", ""]
    parts.append(md_table(headers, body, labels=3) if body else "_no rows in the record_")
    errors = [f"- {r.get('M')}x{r.get('K')}x{r.get('N')} G={r.get('G')} {r.get('layout')}: "
              f"{k}: {v}" for r in record.get("results") or []
              for k, v in (r.get("errors") or {}).items()]
    if errors:
        parts += ["", "Failures recorded by the benchmark:", *errors]
    return "\n".join(parts)


def _gmm_plot(pivot, impls, out: Path) -> Path:
    """Bars of TF/s per implementation for each (shape, op), one layout (balanced if present)."""
    plt = _plt()
    layouts = [k[1] for k in pivot]
    layout = "balanced" if "balanced" in layouts else layouts[0]
    keys = [k for k in pivot if k[1] == layout]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(keys) + 2), 4.5), dpi=110)
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(keys))]
        ys = [pivot[k].get(impl) or 0.0 for k in keys]
        dense = impl == "dense"  # the ceiling: hatched, outlined
        ax.bar(xs, ys, width, label=GMM_IMPLS.get(impl, impl), hatch="//" if dense else None,
               edgecolor="k" if dense else "white")
    ax.set_xticks(range(len(keys)), [f"{s}\n{op}" for s, _, op in keys], fontsize=7,
                  rotation=30, ha="right")
    ax.set_ylabel("TF/s (bf16)")
    ax.set_title(f"Grouped GEMM throughput ({layout} groups)")
    top = max((v or 0.0) for k in keys for v in pivot[k].values())
    ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # headroom for the legend
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    return _save(fig, out)


# ----------------------------------------------------------------------------
# MoE layer.


def _met(value, target) -> str:
    if value is None:
        return "not measured"
    return "met" if value < target else "**not met**"


def moe_section(record: dict, path: Path, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the MoE layer benchmark: cases, time split, targets, plot."""
    cfg, targets = record.get("config", {}), record.get("targets", {})
    tt = targets.get("torchtitan_fwd_bwd_ms")
    vs_torch = record.get("torch_speedup") or {}  # torch_grouped_mm's time over the case's
    body = []
    for r in record.get("rows", []):
        if "error" in r:
            body.append([r["case"], f"error: {r['error'][:80]}", *["-"] * 7])
            continue
        if "skipped" in r:
            body.append([r["case"], f"skipped: {r['skipped']}", *["-"] * 7])
            continue
        ms = r.get("fwd_bwd_ms")
        body.append([r["case"], r.get("backend", "-"), _num(r.get("fwd_ms"), ".2f"),
                     _num(r.get("fwd_tflops"), ".0f"),
                     _num(ms, ".2f") if ms else f"- ({r.get('fwd_bwd_error', 'not run')[:60]})",
                     _num(r.get("fwd_bwd_tflops"), ".0f"),
                     f"{100 * r.get('dropped_fraction', 0):.1f}%",
                     f"{tt / ms:.2f}x" if tt and ms and not cfg.get("tiny") else "-",
                     _num(vs_torch.get(r["case"], {}).get("fwd_bwd"), ".2f")])
    shape = (f"T={cfg.get('tokens')} tokens, D={cfg.get('emb_dim')}, F={cfg.get('moe_mlp_dim')}, "
             f"E={cfg.get('num_experts')} experts, top-{cfg.get('top_k')}, "
             f"{cfg.get('shared_experts')} shared, {cfg.get('dtype')}")
    parts = [f"## {TITLES['moe_layer']} (DeepSeek-V3 shapes, one GPU)",
             _source_line(record, path), "",
             f"{shape}. TF/s count expert FLOPs: {record.get('flops_formula', '')}.", ""]
    ours = next((r for r in record.get("rows", []) if r.get("case") == "ours"), {})
    split = record.get("split") or {}
    if ours or split.get("pieces"):
        fig = _moe_plot(record, fig_dir / "moe_layer.png")
        parts += [f"![MoE layer time]({os.path.relpath(fig, md_dir)})", ""]
    parts += [md_table(["case", "backend", "fwd ms", "fwd TF/s", "fwd+bwd ms", "fwd+bwd TF/s",
                        "tokens dropped", f"speed-up vs torchtitan ({tt} ms)",
                        "speed-up vs torch_grouped_mm (same run)"], body, labels=2), ""]
    if targets and not cfg.get("tiny"):
        parts.append(f"- fwd+bwd < {targets.get('fwd_bwd_ms')} ms on one H200: "
                     f"{_num(ours.get('fwd_bwd_ms'), '.2f')} ms, "
                     f"{_met(ours.get('fwd_bwd_ms'), targets.get('fwd_bwd_ms', 0))} "
                     f"(torchtitan {tt} ms, its bare grouped GEMMs "
                     f"{targets.get('torchtitan_gemm_ms')} ms).")
    if split.get("pieces"):
        share = split.get("routing_share_fwd_bwd_pct")
        parts.append(f"- router + permute + combine < {targets.get('routing_share_pct')}% of the "
                     f"layer's fwd+bwd: {_num(share)}%, "
                     f"{_met(share, targets.get('routing_share_pct', 0))}.")
        total = split.get("layer_fwd_bwd_ms")
        rows = [[p["piece"], _num(p["fwd_ms"], ".3f"), _num(p["fwd_bwd_ms"], ".3f"),
                 _num(100 * p["fwd_bwd_ms"] / total if total else None)] for p in split["pieces"]]
        rows.append(["sum of pieces", _num(split.get("sum_fwd_ms"), ".3f"),
                     _num(split.get("sum_fwd_bwd_ms"), ".3f"), "-"])
        rows.append(["whole layer", _num(split.get("layer_fwd_ms"), ".3f"), _num(total, ".3f"),
                     "100.0" if total else "-"])
        parts += ["", f"Time split of `{split.get('case')}` ({split.get('backend')}): each piece "
                  "is the block's own code jitted alone; the whole layer fuses across pieces, so "
                  "the sum differs from it.", "",
                  md_table(["piece", "fwd ms", "fwd+bwd ms", "% of layer fwd+bwd"], rows)]
    bd = record.get("kernel_breakdown") or {}
    if bd.get("categories"):
        cats = ", ".join(f"{c['label']} {c['pct_kernel']:.1f}%" for c in bd["categories"]
                         if c["pct_kernel"] > 0)
        parts += ["", f"Kernel time of ours' fwd+bwd by category (profiler trace): {cats}."]
    return "\n".join(parts)


def _moe_plot(record: dict, out: Path) -> Path:
    """Left: fwd+bwd time per case with the targets; right: ours' split as stacked bars."""
    plt = _plt()
    rows = [r for r in record.get("rows", []) if r.get("fwd_bwd_ms")]
    split = record.get("split") or {}
    targets = record.get("targets", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=110,
                                   gridspec_kw={"width_ratios": [1.2, 1]})
    ax1.barh([r["case"] for r in rows][::-1], [r["fwd_bwd_ms"] for r in rows][::-1],
             color="#1f77b4")
    for name, key, style in (("target", "fwd_bwd_ms", "--"),
                             ("torchtitan", "torchtitan_fwd_bwd_ms", ":")):
        if targets.get(key) and not record.get("config", {}).get("tiny"):
            ax1.axvline(targets[key], color="k", linestyle=style, label=f"{name} {targets[key]} ms")
    ax1.set_xlabel("fwd+bwd ms (lower is better)")
    ax1.set_title("MoE layer fwd+bwd", fontsize=10)
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=8)
    pieces = split.get("pieces") or []
    for col, key in enumerate(("fwd_ms", "fwd_bwd_ms")):
        left = 0.0
        for p in pieces:
            ax2.barh(col, p[key], left=left, color=SPLIT_COLORS.get(p["piece"], "#888"),
                     label=p["piece"] if col == 0 else None)
            left += p[key]
        layer = split.get(f"layer_{key}")
        if layer and layer > left:
            ax2.barh(col, layer - left, left=left, color=SPLIT_COLORS["unattributed"],
                     label="unattributed" if col == 0 else None)
    ax2.set_yticks([0, 1], ["fwd", "fwd+bwd"])
    ax2.set_xlabel("ms")
    ax2.set_title(f"time split ({split.get('case', '-')})", fontsize=10)
    if pieces:
        ax2.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return _save(fig, out)


# ----------------------------------------------------------------------------
# The page.


def headlines(kind: str, record: dict) -> list[str]:
    """One-line summaries of a record (for the page's top and ``dropless bench``'s table)."""
    if kind.split(":")[0] == "gmm":
        pivot = _pivot(gmm_rows(record))
        keys = [k for k in pivot if k[2] == "fwd" and pivot[k].get("ours")]
        key = next((k for k in keys if k[1] == "balanced"), keys[0] if keys else None)
        if key is None:
            return []
        v = pivot[key]
        return [f"gmm fwd {key[0]} {key[1]}: ours {v['ours']:.0f} TF/s = "
                f"{_ratio(v['ours'], v.get('dense'))} dense, {_ratio(v['ours'], v.get('torch'))} "
                "torch._grouped_mm"]
    if kind.split(":")[0] == "gmm_tile_probe":
        return gmm_tile_probe_headline(record)
    if kind == "moe_layer":
        ours = next((r for r in record.get("rows", []) if r.get("case") == "ours"), {})
        if not ours.get("fwd_bwd_ms"):
            return []
        tt = (record.get("targets") or {}).get("torchtitan_fwd_bwd_ms")
        share = (record.get("split") or {}).get("routing_share_fwd_bwd_pct")
        line = (f"MoE layer fwd+bwd: ours {ours['fwd_bwd_ms']:.1f} ms "
                f"({_num(ours.get('fwd_bwd_tflops'), '.0f')} TF/s)")
        if tt and not record.get("config", {}).get("tiny"):
            line += f", {tt / ours['fwd_bwd_ms']:.2f}x torchtitan's {tt} ms"
        return [line + (f"; routing+permute+combine {share:.1f}%" if share is not None else "")]
    if kind.split(":")[0] == "fp8_kernels":
        return fp8_kernels_headline(kind.partition(":")[2] or fp8_kernels_variant(record), record)
    if kind == "fp8_quant":
        return fp8_quant_headline(record)
    if kind == "fp8_loss":
        return fp8_loss_headline(record)
    if kind.split(":")[0] == "profile":
        return profile_headline(kind.partition(":")[2] or profile_precision(record), record)
    if kind.split(":")[0] == "step":
        return step_headline(kind.partition(":")[2] or step_variant(record), record)
    return []


SECTIONS = {"gmm": gmm_section, "gmm_tile_probe": gmm_tile_probe_section, "moe_layer": moe_section,
            "step": step_section, "profile": profile_section, "fp8_kernels": fp8_kernels_section,
            "fp8_quant": fp8_quant_section, "fp8_dense": fp8_dense_section}


def render(results_dir=DEFAULT_RESULTS_DIR, md_path=DEFAULT_MD, log=print,
           include_cpu: bool = False) -> Path:
    """Write the results page (and ``figures/`` beside it) from the newest records.

    Args:
      results_dir: where the records are.
      md_path: the page to write; plots go to ``figures/`` next to it.
      log: called with one line per skipped file or failed section.
      include_cpu: also render CPU runs (tests, smoke runs).

    Returns:
      The markdown path. Sections without a record say so.
    """
    md_path = Path(md_path)
    md_dir = md_path.parent
    fig_dir = md_dir / "figures"
    found = list(valid_records(results_dir, log=log, include_cpu=include_cpu))
    records = _newest(found)
    # The models variant shows the newest row of each case over all its records.
    history = {"step": {"models": [(rec, path, when) for key, rec, path, when in found
                                   if key == "step:models"]}}
    parts = ["# dropless benchmark results", "",
             "Generated by `python -m dropless.perf.report` from the newest record of each kind "
             f"in `{os.path.relpath(Path(results_dir), md_dir)}/`; do not edit by hand. "
             "Reproduce on one GPU with `dropless bench` (or `PYTHONPATH=src python3 -m "
             "dropless.perf.bench`), then rerun the report.", ""]
    sources = [[kind, f"`{path.name}`", provenance(rec)["gpu"], provenance(rec)["jax"],
                f"`{_short_commit(provenance(rec)['commit'])}`",
                str(_get(rec, *CREATED, default="?"))]
               for kind, (rec, path) in sorted(records.items())]
    lines = [f"- {h}" for kind, (rec, _) in sorted(records.items()) for h in headlines(kind, rec)]
    if lines:
        parts += ["**Headline**", "", *lines, ""]
    if sources:
        parts += [md_table(["kind", "file", "GPU", "jax", "commit", "created"], sources,
                           labels=6), ""]
    for kind, section in SECTIONS.items():
        variants = {k.partition(":")[2]: v for k, v in records.items()
                    if kind in VARIANTS and k.startswith(kind + ":")}
        if kind in records or variants:
            names = ", ".join(p.name for _, p in variants.values()) or records[kind][1].name
            try:
                parts += [section(variants, fig_dir, md_dir, **history.get(kind, {})) if variants
                          else section(*records[kind], fig_dir, md_dir), ""]
            except Exception as e:  # noqa: BLE001 - one malformed record must not hide the rest
                log(f"could not render {names}: {type(e).__name__}: {e}")
                parts += [f"## {TITLES[kind]}", f"_could not render `{names}`: {e}_", ""]
        else:
            parts += [f"## {TITLES[kind]}", "_no results yet_", ""]
    md_dir.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(parts).rstrip() + "\n")
    return md_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--md", type=Path, default=DEFAULT_MD)
    parser.add_argument("--include-cpu", action="store_true", help="also render CPU runs")
    args = parser.parse_args(argv)
    path = render(args.results, args.md, include_cpu=args.include_cpu)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
