"""The row-tile probe's section of ``benchmarks/RESULTS.md`` (``benchmarks/gmm_tile_probe.py``):
the bf16 grouped GEMM's forward and dgrad under each tiling, at each shape and group-size
layout, against the dense cuBLAS product at equal FLOPs.

A record's rows: ``shape`` [M, G, K, N], ``layout``, ``product`` (fwd | dgrad), ``tiling``
(a name of the probe's ``TILINGS``), ``tiling_config``, ``tiles``, ``overhead``,
``kernel_ms``, ``wall_ms``, ``tflops_kernel``, ``tflops_wall``, ``vs_dense``, and
``bitwise_equal_to`` / ``equal`` (against the first tiling timed); or ``skipped`` / ``error``
instead of the numbers. ``dense`` holds the dense product's times per "M,G,K,N" and product.
Any field may be missing (its cell renders "-").
"""

from pathlib import Path

from dropless.perf.report_md import TITLES, _num, _ratio, _source_line, md_table

HEADERS = ["shape (M G K N)", "layout", "product", "tiling", "live row tiles", "overhead",
           "kernel ms", "wall ms", "TF/s (CUPTI)", "TF/s (wall)", "x dense", "equal bits"]


def _shape(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else () if value is None else (value,)


def _shapes(record: dict) -> list[tuple]:
    """The record's shapes (M, G, K, N): its config's, else its rows' in first-seen order."""
    listed = (record.get("config") or {}).get("shapes")
    shapes = [_shape(s) for s in listed] if listed else [_shape(r["shape"]) for r in
                                                          record.get("rows", []) if "shape" in r]
    return list(dict.fromkeys(shapes))


def _scope(record: dict, key: str) -> list:
    """The record's ``layouts`` or ``products``: its config's, else its rows'."""
    listed = (record.get("config") or {}).get(key + "s")
    return listed or list(dict.fromkeys(r[key] for r in record.get("rows", []) if key in r))


def _shape_text(shape: tuple) -> str:
    return " ".join(f"{k}={v}" for k, v in zip("MGKN", shape))


def gmm_tile_probe_variant(record: dict) -> str:
    """What a probe record times: its shapes, layouts and products (``--shape``,
    ``--layouts``, ``--products``). A probe at G=32 does not replace one at G=256; a rerun of
    the same scope (with other ``--tilings``) does."""
    shapes = "; ".join(_shape_text(s) for s in _shapes(record)) or "no shapes"
    layouts, products = (", ".join(_scope(record, key)) for key in ("layout", "product"))
    return f"{shapes} ({layouts}; {products})"


def _dense(record: dict, shape: tuple, product) -> dict:
    """The dense product's row at ``shape`` ({} when the record lacks it)."""
    by_shape = (record.get("dense") or {}).get(",".join(map(str, shape))) or {}
    return by_shape.get(product) or {}


def _cell(text) -> str:
    """A recorded message as one table cell: one line, no column separator, short."""
    return " ".join(str(text).split()).replace("|", "/")[:80]


def _equal(row: dict) -> str:
    if "equal" in row:
        return "yes" if row["equal"] else "**no**"
    return "ref" if row.get("tflops_kernel") or row.get("wall_ms") else "-"


def _tiling_text(cfg: dict) -> str:
    text = (f"{cfg.get('block_m')} x {cfg.get('block_n')} x {cfg.get('block_k')}, "
            f"{cfg.get('num_stages')} stages, grid tile width {cfg.get('grid_tile_width')}")
    return text + (", chained" if cfg.get("chain") else "")


def _tilings_line(record: dict) -> str:
    """Each tiling name with the tile(s) it ran (``table`` may resolve to several)."""
    configs = {}
    for r in record.get("rows", []):
        if isinstance(r.get("tiling_config"), dict):
            configs.setdefault(r.get("tiling", "-"), {})[_tiling_text(r["tiling_config"])] = None
    if not configs:
        return ""
    return "Tilings (block_m x block_n x block_k): " + "; ".join(
        f"`{name}` {' or '.join(tiles)}" for name, tiles in configs.items()) + "."


def _row(shape: tuple, layout, product, tiling, r: dict, x_dense: str, equal: str) -> list:
    why = (f"skipped: {_cell(r['skipped'])}" if "skipped" in r
           else f"error: {_cell(r['error'])}" if "error" in r else None)
    tiles = why or ("-" if r.get("tiles") is None else str(r["tiles"]))
    return [" ".join(map(str, shape)) or "-", layout or "-", product or "-", tiling, tiles,
            _num(r.get("overhead"), ".3f"), _num(r.get("kernel_ms"), ".3f"),
            _num(r.get("wall_ms"), ".3f"), _num(r.get("tflops_kernel"), ".0f"),
            _num(r.get("tflops_wall"), ".0f"), x_dense, equal]


def _probe_table(record: dict) -> str:
    """The record's rows, each (shape, layout, product) led by its dense product's row."""
    body, led = [], set()
    for r in record.get("rows", []):
        shape, layout, product = _shape(r.get("shape")), r.get("layout"), r.get("product")
        dense = _dense(record, shape, product)
        if product and (shape, layout, product) not in led and dense:
            led.add((shape, layout, product))
            body.append(_row(shape, layout, product, "dense cuBLAS", dense, "1.00x"
                             if dense.get("tflops_kernel") else "-", "-"))
        x_dense = r.get("vs_dense")
        x_dense = (f"{x_dense:.2f}x" if x_dense is not None
                   else _ratio(r.get("tflops_kernel"), dense.get("tflops_kernel")))
        body.append(_row(shape, layout, product, r.get("tiling", "-"), r, x_dense, _equal(r)))
    return md_table(HEADERS, body, labels=4) if body else "_no rows in the record_"


def gmm_tile_probe_section(variants: dict, fig_dir: Path, md_dir: Path) -> str:
    """Markdown for the row-tile probe: one table per record (``gmm_tile_probe_variant``),
    by shape.

    Args:
      variants: ``gmm_tile_probe_variant`` -> (record, path).
    """
    parts = [f"## {TITLES['gmm_tile_probe']}", "",
             "`benchmarks/gmm_tile_probe.py`: the bf16 grouped GEMM's forward (x @ w[g]) and "
             "dgrad (dy @ w[g]^T) under each tiling, on `gmm.py`'s group sizes. A row block "
             "holding a group boundary is computed once per group in it: live row tiles are the "
             "schedule's, overhead = tiles / (M / block_m). TF/s count real rows (2 x rows x K x "
             "N); x dense: CUPTI TF/s over the dense cuBLAS product's at equal FLOPs (its own "
             "row). Equal bits: the output against the first tiling timed (ref), bit for bit; "
             "reported, not asserted (a tiling may sum in another order)."]
    for name in sorted(variants, key=lambda v: (_shapes(variants[v][0]), v)):
        record, path = variants[name]
        tilings = _tilings_line(record)
        parts += ["", f"### {name}", _source_line(record, path), "",
                  *([tilings, ""] if tilings else []), _probe_table(record)]
    return "\n".join(parts)


def gmm_tile_probe_headline(record: dict) -> list[str]:
    """At the record's first skewed fwd (shape, layout), else its first timed one: the fastest
    tiling's CUPTI TF/s against the tuning table's tiling and the dense product."""
    timed = {}
    for r in record.get("rows", []):
        if r.get("tflops_kernel"):
            key = (_shape(r.get("shape")), r.get("layout"), r.get("product"))
            timed.setdefault(key, []).append(r)
    if not timed:
        return []
    key = next((k for k in timed if k[2] == "fwd" and k[1] != "balanced"),
               next((k for k in timed if k[2] == "fwd"), next(iter(timed))))
    shape, layout, product = key
    best = max(timed[key], key=lambda r: r["tflops_kernel"])
    table = next((r for r in timed[key] if r.get("tiling") == "table"), None)
    tf = best["tflops_kernel"]
    if best is table:
        line = f"best the table's tiling {tf:.0f} TF/s"
    elif table:
        line = (f"best {best['tiling']} {tf:.0f} TF/s = {_ratio(tf, table['tflops_kernel'])} the "
                f"table's {table['tflops_kernel']:.0f}")
    else:
        line = f"best {best['tiling']} {tf:.0f} TF/s (the table's tiling not timed)"
    dense = _dense(record, shape, product).get("tflops_kernel")
    if dense:
        line += f", {_ratio(tf, dense)} dense ({dense:.0f})"
    return [f"gmm row-tile probe {product} {_shape_text(shape)} {layout} (CUPTI): {line}"]
