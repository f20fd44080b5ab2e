"""What every section of ``benchmarks/RESULTS.md`` shares: the section titles, a record's
provenance and source line, number and table formatting, and matplotlib.

The section modules (``report_step``, ``report_profile``, ``report_fp8``,
``report_gmm_probe``) and ``report`` import from here; this module imports none of them.
"""

from pathlib import Path

TITLES = {"gmm": "Grouped GEMM kernels", "gmm_tile_probe": "Grouped GEMM row tiles under skew",
          "moe_layer": "MoE layer", "step": "Training step", "fp8_kernels": "FP8 grouped GEMM kernels",
          "fp8_quant": "FP8 quantization and the kernel path", "profile": "Step profile",
          "fp8_dense": "FP8 dense matmuls"}


def _get(d: dict, *names, default=None):
    for name in names:
        if isinstance(d, dict) and d.get(name) is not None:
            return d[name]
    return default


def provenance(record: dict) -> dict:
    """{'gpu', 'jax', 'commit'} of a record, from our fields or the benchmarks' own names."""
    device = record.get("device") if isinstance(record.get("device"), dict) else {}
    versions = record.get("versions") if isinstance(record.get("versions"), dict) else {}
    commit = record.get("commit")
    if isinstance(commit, dict):
        # A record taken from a tree with uncommitted changes says so.
        commit = commit.get("commit") and (commit["commit"] + ("+dirty" if commit.get("dirty")
                                                               else ""))
    return {"gpu": _get(device, "gpu", "device_kind") or _get(record, "gpu", "device_kind"),
            "jax": _get(versions, "jax") or _get(record, "jax", "jax_version"),
            "commit": commit}


CREATED = ("created", "date", "timestamp", "time")  # when a record was taken (step.py: "time")


def _num(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def fp8_impl_text(impl) -> str:
    """``gmm_fp8_impl_resolved`` ({"wi": "kernel", "wo": "kernel"}) as one word when the
    matmuls agree, else per matmul."""
    if not isinstance(impl, dict) or not impl:
        return "-" if impl is None else str(impl)
    values = set(impl.values())
    return values.pop() if len(values) == 1 else ", ".join(f"{k}={v}" for k, v in impl.items())


def md_table(headers: list[str], rows: list[list], labels: int = 1) -> str:
    """A GitHub-flavoured markdown table: ``labels`` columns left-aligned, the rest right."""
    align = [":---" if i < labels else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _source_line(record: dict, path: Path) -> str:
    prov = provenance(record)
    created = _get(record, *CREATED, default="?")
    # A benchmark that rewrites its record as it goes marks it "complete": false until
    # the end; a run cut by its time limit leaves that mark, and the rows it timed.
    cut = " **Cut short: only the rows it timed.**" if record.get("complete") is False else ""
    return (f"Source: `{path.name}` ({prov['gpu']}, jax {prov['jax']}, commit "
            f"`{_short_commit(prov['commit'])}`, {created}).{cut}")


def _short_commit(commit) -> str:
    text = str(commit)
    base = text.removesuffix("+dirty")
    return base[:12] + ("+dirty" if base != text else "")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> Path:
    """Lay out ``fig``, write it to ``out`` (making its folder) and close it."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    _plt().close(fig)
    return out


def _ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"
