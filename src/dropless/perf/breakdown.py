"""Where the kernel time goes: categorise kernels by name, sum, and report.

Categories (``CATEGORIES``): grouped GEMM, dense GEMM, attention, FP8
quantization, communication, host<->device copies, other. A kernel's category is decided by
``RULES``, an ordered table of regular expressions: the first rule that
matches wins. A rule looks either at the kernel name (``field="kernel"``) or at
the XLA op the kernel was launched for (``field="op"``: HLO instruction and jax
op-name stack, see ``trace.KernelEvent.op``). The op field matters for
``lax.ragged_dot``: XLA runs it as cuBLAS kernels whose names say nothing of
grouping, but whose op name does.

Why this order:
1. Communication first: NCCL kernels and XLA collectives are never anything
   else, and a peer-to-peer memcpy is GPU-to-GPU traffic, not offload.
2. Host<->device copies (CUPTI's MemcpyH2D/D2H): offloaded activations,
   input batches, host reads. Device-to-device copies fall through to other.
3. Attention kernels (cuDNN flash / fmha / sdpa) before GEMMs, because their
   names can contain "gemm"-like words and Mosaic attention kernels would
   otherwise look like our grouped GEMMs. Softmax fusions count as attention
   (the router's softmax, if any, is counted there too: it is tiny).
4. FP8 quantization before the GEMMs: our Pallas quantization kernels
   (``ops/gmm/fp8_quant_kernels.py``: ``_rows_kernel``, ``_columns_kernel``,
   ``_weight_kernel``) by name, and XLA's quantize / amax fusions by op: the
   ``fp8_quantize`` name scope of ``ops.quant``'s quantizers, or an ``f8``
   result that ``hlo.kernel_ops`` read from the optimized HLO (kernels in
   CUDA graphs carry no op name in the trace; the HLO dump still names
   them), or the jitted Pallas quantizers (``jit(quantize_rows)``, ...) in
   the op, whatever name the kernel gets. A quantization inside the gmm's
   scope is quantization, so this precedes the grouped GEMM op rule; GEMMs
   are not claimed by it: the quantizers hold no dot, and ``hlo.kernel_ops``
   tags only non-GEMM instructions.
5. Grouped GEMM: our Mosaic GPU kernels (bf16 and FP8), anything named gmm/tgmm (never the
   "gmma" of Hopper's ``wgmma`` instruction), and by op name XLA's
   ragged_dot, before the dense rules that would claim its cuBLAS kernels.
6. Dense GEMM: cuBLAS / cuBLASLt (``sm90_xmma_*``, ``nvjet_*``, FP8 ones
   such as ``sm90_xmma_gemm_e4m3e4m3_*`` and ``__cublas$lt$matmul$f8``), CUTLASS,
   Triton GEMM fusions, XLA:CPU dots (``dot``, YNNPACK ``ynn_fusion``) and
   convolutions.
7. Everything else: elementwise and reduction fusions, sorts, gathers,
   scatters, D2D copies, memsets.

Percentages: ``pct_kernel`` is a category's share of the summed kernel time;
``pct_wall`` its time over (wall time x devices), where wall time spans the
profiled steps (first step start, or first kernel, to the last step or kernel
end). On CPU, ops on several threads can overlap, so ``pct_wall`` may add up
to more than 100.
"""

import dataclasses
import re
import statistics
from collections import defaultdict

from dropless.perf.trace import KernelEvent, Trace

GROUPED_GEMM = "grouped_gemm"
DENSE_GEMM = "dense_gemm"
ATTENTION = "attention"
QUANTIZATION = "quantization"
COMMUNICATION = "communication"
COPY = "host_device_copy"
OTHER = "other"
CATEGORIES = (GROUPED_GEMM, DENSE_GEMM, ATTENTION, QUANTIZATION, COMMUNICATION, COPY, OTHER)
LABELS = {
    GROUPED_GEMM: "grouped GEMM",
    DENSE_GEMM: "dense GEMM",
    ATTENTION: "attention",
    QUANTIZATION: "FP8 quantization",
    COMMUNICATION: "communication",
    COPY: "host<->device copy",
    OTHER: "other",
}
COLORS = {
    GROUPED_GEMM: "#1f77b4",
    DENSE_GEMM: "#17becf",
    ATTENTION: "#9467bd",
    QUANTIZATION: "#bcbd22",
    COMMUNICATION: "#d62728",
    COPY: "#ff7f0e",
    OTHER: "#7f7f7f",
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """Kernels whose ``field`` ("kernel" name or "op") matches ``pattern`` are ``category``."""

    category: str
    field: str
    pattern: re.Pattern
    why: str

    def matches(self, name: str, op: str) -> bool:
        return bool(self.pattern.search(name if self.field == "kernel" else op))


def _rule(category, field, pattern, why):
    return Rule(category, field, re.compile(pattern, re.IGNORECASE), why)


# The op-text marker of FP8 quantization: ops.quant's name scope, or the tag
# hlo.kernel_ops gives a non-GEMM HLO instruction with an f8 result.
QUANT_SCOPE = "fp8_quantize"
F8_RESULT_TAG = "f8_result"

# "gmm" as a word-ish token: not the "gmma" of wgmma / CUTLASS's TmaGmma names.
_GMM = r"(?<![a-z])t?gmm(?!a)"

RULES: tuple[Rule, ...] = (
    _rule(COMMUNICATION, "kernel", r"nccl|nvshmem", "NCCL / NVSHMEM kernels"),
    _rule(COMMUNICATION, "kernel",
          r"all[-_]?reduce|all[-_]?gather|reduce-scatter|reducescatter|all[-_]?to[-_]?all"
          r"|collective[-_]?permute|sendrecv|memcpyp2p|memcpy_?peer",
          "XLA collectives (incl. ragged all-to-all) and GPU peer copies; 'reduce_scatter' "
          "with an underscore is left out: XLA names a reduce+scatter fusion that way"),
    _rule(COMMUNICATION, "kernel", r"^(send|recv)(-start|-done)?(\.\d+)?$", "XLA send/recv ops"),
    _rule(COPY, "kernel", r"memcpy.?(h2d|d2h|htod|dtoh)", "CUPTI host<->device memcpy"),
    _rule(ATTENTION, "kernel", r"flash|fmha|sdpa|attention|attn|(^|[_:\s])mha",
          "cuDNN / flash / fused multi-head attention kernels"),
    _rule(ATTENTION, "kernel", r"softmax", "softmax fusions"),
    _rule(QUANTIZATION, "kernel",
          r"(?<![a-z])_?(rows|columns|weight)_kernel|quantiz|amax",
          "our Pallas FP8 quantization kernels (fp8_quant_kernels.py), quantize/amax kernels"),
    _rule(GROUPED_GEMM, "kernel",
          rf"mosaic_gpu|ragged[-_]?dot|grouped[-_]?(gemm|mm|matmul)|{_GMM}",
          "our Mosaic GPU grouped matmul kernels, XLA ragged_dot fusions"),
    _rule(QUANTIZATION, "op",
          rf"{QUANT_SCOPE}|{F8_RESULT_TAG}|jit\(quantize_(rows|columns|weight)\)",
          "XLA fusions of ops.quant's quantizers (amax, scale, convert to f8), by name scope "
          "or by their f8 result in the optimized HLO; the jitted Pallas quantizers by op"),
    _rule(GROUPED_GEMM, "op", rf"ragged[-_]?dot|{_GMM}",
          "kernels XLA launches for lax.ragged_dot (cuBLAS on a masked dense dot)"),
    _rule(DENSE_GEMM, "kernel",
          r"gemm|xmma|cutlass|cublas|nvjet|__nv_|matmul|wgmma|hmma|(?<![a-z])dot(?![a-z])"
          r"|conv(olution)?(?![a-z])|[xy]nn_fusion",
          "cuBLAS/cuBLASLt, CUTLASS, Triton GEMM fusions; XLA:CPU dots and YNNPACK fusions"),
    _rule(OTHER, "kernel", r"", "everything else"),
)


def categorise(name: str, op: str = "") -> str:
    """The category of a kernel: the first rule of ``RULES`` that matches.

    Args:
      name: kernel name (GPU) or HLO instruction name (CPU).
      op: the XLA op / jax op-name text of the kernel, "" if unknown.

    Returns:
      One of ``CATEGORIES``.
    """
    for rule in RULES:
        if rule.matches(name, op):
            return rule.category
    return OTHER  # unreachable: the last rule matches everything


@dataclasses.dataclass
class Breakdown:
    """Kernel time by category and the top kernels of one trace (JSON-ready via ``to_dict``).

    categories: one dict per category in ``CATEGORIES`` order: category, label,
      time_us, count, pct_kernel, pct_wall.
    top_kernels: up to ``top`` dicts, most time first: name, category, time_us,
      count, avg_us, pct_kernel.
    top_by_category: category -> up to ``top`` such dicts of that category,
      each with ``op``, the start of its HLO op text (what a fusion computes:
      the names alone, ``loop_convert_fusion_3``, do not say), and its launch
      durations (``min_us``, ``median_us``, ``max_us``, ``durations_us`` in
      trace order, the first ``DURATIONS_KEPT``): launches of one kernel name
      that do different work (one Mosaic name serves every grouped GEMM) show
      up as groups of durations), and ``launch_ops`` (``_launch_ops``): the
      HLO op each of those launches ran for.
    wall_us: span of the profiled steps; kernel_us: summed kernel time (all
      devices); busy_pct: time any kernel ran on a device / wall, averaged
      over devices.
    """

    trace: str
    platform: str
    devices: list[str]
    steps: int
    wall_us: float
    kernel_us: float
    busy_pct: float
    categories: list[dict]
    top_kernels: list[dict]
    notes: list[str]
    top_by_category: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def pct(self, category: str, of: str = "kernel") -> float:
        """A category's ``pct_kernel`` (of="kernel") or ``pct_wall`` (of="wall")."""
        row = next(c for c in self.categories if c["category"] == category)
        return row[f"pct_{of}"]


def _wall_span(trace: Trace):
    starts = [k.start_us for k in trace.kernels] + [s.start_us for s in trace.steps]
    ends = [k.start_us + k.dur_us for k in trace.kernels] + [s.end_us for s in trace.steps]
    if trace.steps:
        # Kernels still running from before the first step (e.g. the warm-up's
        # tail) do not widen the window; kernels after the last step do, since
        # the device finishes the last step after the host has moved on.
        first = min(s.start_us for s in trace.steps)
        starts = [first]
    return (min(starts), max(ends)) if starts and ends else (0.0, 0.0)


def _busy_us(kernels: list[KernelEvent]) -> float:
    """Union of kernel intervals: time at least one kernel ran."""
    total, cur_start, cur_end = 0.0, None, None
    for k in sorted(kernels, key=lambda k: k.start_us):
        end = k.start_us + k.dur_us
        if cur_end is None or k.start_us > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = k.start_us, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _pct(part, whole):
    return 100.0 * part / whole if whole > 0 else 0.0


OP_TEXT_CHARS = 240  # of a kernel's HLO op text kept in ``top_by_category``
DURATIONS_KEPT = 256  # launch durations kept per kernel in ``top_by_category`` (in trace order)


def _launch_ops(ops: list[str]) -> dict:
    """Which HLO op (and jax name stack) each launch of one kernel name ran for, compactly:
    the distinct op texts and, per launch in trace order, the index of its text. Launches
    of one name from different HLO instructions (a forward GEMM and its recomputation,
    say) differ here where their durations alone cannot tell them apart."""
    names = list(dict.fromkeys(ops))
    where = {op: i for i, op in enumerate(names)}
    return {"names": names, "index": [where[op] for op in ops]}


def compute(trace: Trace, top: int = 15, hlo_ops: dict | None = None) -> Breakdown:
    """Categorise and sum the kernels of ``trace``.

    Args:
      trace: from ``trace.load_trace``.
      top: how many kernels (aggregated by name) to list.
      hlo_ops: HLO module -> kernel name -> extra op text (``hlo.kernel_ops``),
        appended to each kernel's op before it is categorised.

    Returns:
      A ``Breakdown``; ``pct_kernel`` over categories sums to 100 when any
      kernel time was recorded (0 everywhere otherwise, with a note).
    """
    start, end = _wall_span(trace)
    wall = max(0.0, end - start)
    ndev = max(1, len(trace.devices))
    per_cat = {c: [0.0, 0] for c in CATEGORIES}
    per_name = defaultdict(lambda: [0.0, 0, OTHER])
    durations = defaultdict(list)
    launch_ops = defaultdict(list)
    op_text = {}
    hlo_ops = hlo_ops or {}
    for k in trace.kernels:
        extra = hlo_ops.get(k.module, {}).get(k.name, "")
        cat = categorise(k.name, f"{k.op} {extra}" if extra else k.op)
        per_cat[cat][0] += k.dur_us
        per_cat[cat][1] += 1
        agg = per_name[k.name]
        agg[0] += k.dur_us
        agg[1] += 1
        agg[2] = cat
        durations[k.name].append(k.dur_us)
        if len(ops := launch_ops[k.name]) < DURATIONS_KEPT:  # only these are reported
            ops.append(k.op[:OP_TEXT_CHARS])
        op_text.setdefault(k.name, f"{k.op} {extra}".strip()[:OP_TEXT_CHARS])
    total = sum(v[0] for v in per_cat.values())
    categories = [
        {"category": c, "label": LABELS[c], "time_us": t, "count": n,
         "pct_kernel": _pct(t, total), "pct_wall": _pct(t, wall * ndev)}
        for c, (t, n) in per_cat.items()
    ]
    ranked = sorted(per_name.items(), key=lambda kv: (-kv[1][0], kv[0]))
    top_kernels = [
        {"name": name, "category": cat, "time_us": t, "count": n, "avg_us": t / n,
         "pct_kernel": _pct(t, total)}
        for name, (t, n, cat) in ranked[:top]
    ]
    by_category = defaultdict(list)
    for name, (t, n, cat) in ranked:
        if len(by_category[cat]) < top:
            d = durations[name]
            by_category[cat].append({"name": name, "time_us": t, "count": n, "avg_us": t / n,
                                     "min_us": min(d), "median_us": statistics.median(d),
                                     "max_us": max(d),
                                     "durations_us": [round(x, 1) for x in d[:DURATIONS_KEPT]],
                                     "launch_ops": _launch_ops(launch_ops[name]),
                                     "pct_kernel": _pct(t, total), "op": op_text.get(name, "")})
    by_device = defaultdict(list)
    for k in trace.kernels:
        by_device[k.device].append(k)
    busy = sum(_busy_us(ks) for ks in by_device.values())
    notes = _notes(trace, total)
    return Breakdown(trace.path, trace.platform, list(trace.devices), len(trace.steps), wall,
                     total, _pct(busy, wall * ndev), categories, top_kernels, notes,
                     dict(by_category))


def _notes(trace: Trace, total: float) -> list[str]:
    notes = []
    if not trace.kernels or total <= 0:
        notes.append("no kernel time in the trace: nothing ran, or the profiler saw no device")
    if any("cudagraph" in k.name.lower().replace(" ", "") for k in trace.kernels):
        notes.append("whole CUDA graphs appear as single events (command buffers); their kernels "
                     "are counted as 'other'. Profile with xla_gpu_enable_command_buffer='' to "
                     "see each kernel.")
    if not trace.steps:
        notes.append("no StepTraceAnnotation in the trace: wall time is the span of the kernels")
    return notes


# ----------------------------------------------------------------------------
# Output: rich tables, a PNG bar chart, JSON.


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def tables(bd: Breakdown):
    """Two ``rich.table.Table``s: time by category, and the top kernels."""
    from rich.table import Table

    devices = ", ".join(bd.devices) or "none"
    cats = Table(title=f"Kernel time by category ({bd.platform}: {devices})")
    for col in ("category", "time (ms)", "% of kernel time", "% of wall time", "kernels"):
        cats.add_column(col, justify="left" if col == "category" else "right")
    for c in bd.categories:
        cats.add_row(c["label"], f"{c['time_us'] / 1e3:.3f}", f"{c['pct_kernel']:.1f}",
                     f"{c['pct_wall']:.1f}", str(c["count"]))
    cats.add_row("total", f"{bd.kernel_us / 1e3:.3f}", "100.0" if bd.kernel_us else "0.0",
                 f"{sum(c['pct_wall'] for c in bd.categories):.1f}",
                 str(sum(c["count"] for c in bd.categories)), style="bold")
    step_ms = bd.wall_us / bd.steps / 1e3 if bd.steps else float("nan")
    cats.caption = (f"wall {bd.wall_us / 1e3:.3f} ms over {bd.steps} steps "
                    f"({step_ms:.3f} ms/step); device busy {bd.busy_pct:.1f}%")
    top = Table(title=f"Top {len(bd.top_kernels)} kernels")
    for col in ("#", "kernel", "category", "time (ms)", "% kernel", "count", "avg (us)"):
        top.add_column(col, justify="left" if col in ("kernel", "category") else "right")
    for i, k in enumerate(bd.top_kernels, 1):
        top.add_row(str(i), _short(k["name"]), LABELS[k["category"]], f"{k['time_us'] / 1e3:.3f}",
                    f"{k['pct_kernel']:.1f}", str(k["count"]), f"{k['avg_us']:.1f}")
    return cats, top


def print_breakdown(bd: Breakdown, console=None) -> None:
    """Print the category and top-kernel tables, then any notes."""
    import sys

    from rich.console import Console

    # Logs and captured output are not terminals: give kernel names room there.
    console = console or (Console() if sys.stdout.isatty() else Console(width=160))
    for table in tables(bd):
        console.print(table)
    for note in bd.notes:
        console.print(f"[yellow]note:[/] {note}")


def plot(bd: Breakdown, path, title: str = "Where the time goes") -> None:
    """Horizontal bars per category: % of kernel time and % of wall time, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = [c["label"] for c in bd.categories][::-1]
    kernel = [c["pct_kernel"] for c in bd.categories][::-1]
    wall = [c["pct_wall"] for c in bd.categories][::-1]
    colors = [COLORS[c["category"]] for c in bd.categories][::-1]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=120)
    ys = range(len(labels))
    ax.barh([y + 0.2 for y in ys], kernel, height=0.4, color=colors)
    ax.barh([y - 0.2 for y in ys], wall, height=0.4, color=colors, alpha=0.45)
    for y, k in zip(ys, kernel):
        ax.text(k + 0.5, y + 0.2, f"{k:.1f}", va="center", fontsize=8)
    ax.set_yticks(list(ys), labels)
    ax.set_xlabel("%")
    ax.set_xlim(0, max(100.0, max(kernel + wall, default=0) * 1.1))
    ax.set_title(f"{title} ({bd.platform}, {bd.steps} steps, "
                 f"{bd.wall_us / max(bd.steps, 1) / 1e3:.2f} ms/step)", fontsize=10)
    # Neutral swatches: the bar colours encode the category, the shade the denominator.
    ax.legend(handles=[Patch(color="0.35", label="% of kernel time"),
                       Patch(color="0.35", alpha=0.45, label="% of wall time")],
              loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save(bd: Breakdown, path, extra: dict | None = None) -> None:
    """Write the breakdown (plus ``extra`` keys, e.g. the run's config) as JSON."""
    import json

    data = bd.to_dict()
    data["rules"] = [{"category": r.category, "field": r.field, "pattern": r.pattern.pattern}
                     for r in RULES]
    data.update(extra or {})
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
