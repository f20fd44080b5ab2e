"""Read a ``jax.profiler`` trace and pull out the device kernels and the steps.

``jax.profiler.trace(log_dir)`` (jax 0.11.2) writes
``log_dir/plugins/profile/<timestamp>/<host>.trace.json.gz``: Chrome trace
JSON converted from the XSpace by XLA's ``ConvertXSpaceToTraceEvents``, plus
``perfetto_trace.json.gz`` (the same events without metadata) when asked.

Layout, as that converter and the CUPTI collector write it:

- Every XPlane becomes a "process" (``pid``) whose ``process_name`` metadata is
  the plane name: ``/host:CPU`` for all host threads, ``/device:GPU:<n>`` for
  each GPU. Every XLine becomes a "thread" (``tid``) with a ``thread_name``.
- On a GPU plane, CUPTI puts kernels and copies on one line per CUDA stream,
  named ``Stream #<id>(<event types>)``; memcpy events are named after their
  kind (``MemcpyH2D``, ``MemcpyD2H``, ``MemcpyD2D``, ``MemcpyP2P``). Events
  carry the XLA annotation as args: ``hlo_op`` (HLO instruction),
  ``hlo_module``, and ``name`` (the jax op-name stack, minus the prefix shared
  by the whole module). Stream events do not nest, but they can overlap:
  with programmatic dependent launch (Mosaic GPU kernels use it) a kernel
  starts before its predecessor on the stream ends. Each counts in full.
- On CPU there is no device plane: XLA:CPU records each executed thunk as a
  host-thread event named after its HLO instruction, with ``hlo_op`` and
  ``hlo_module`` args. Control-flow thunks (``while``, ``conditional``) enclose
  their bodies' thunks on the same thread, so kernel time is counted as
  *exclusive* time (duration minus nested kernel events).
- ``jax.profiler.StepTraceAnnotation(name, step_num=i)`` becomes a host event
  named ``name`` with a ``step_num`` arg.

Times in the JSON are microseconds.
"""

import dataclasses
import gzip
import json
import os
import re
from collections import defaultdict
from pathlib import Path

GPU_PROCESS = re.compile(r"^/device:GPU:(\d+)")
# Lines that profiler post-processing may add next to the stream lines. They
# repeat the kernels' time under another name and must not be counted twice.
DERIVED_LINES = frozenset(
    {"XLA Ops", "XLA Modules", "Steps", "Framework Ops", "Framework Name Scope",
     "Source code", "TensorFlow Ops", "Launch Stats", "Kernel Launch", "CUPTI overhead"}
)
# Annotation args that name the XLA op a kernel belongs to, in order of use.
OP_ARGS = ("hlo_op", "name", "op_name")


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    """One device kernel (GPU) or one executed XLA op (CPU).

    name: kernel name (GPU; demangled by CUPTI) or HLO instruction (CPU).
    op: the HLO op and jax op-name stack from the annotation args, space
      separated ("" when the trace has none).
    module: the HLO module (jitted function) it ran in, "" if unknown.
    start_us, dur_us: start and *exclusive* duration in microseconds.
    device: the process name, e.g. "/device:GPU:0" or "/host:CPU".
    lane: the stream or thread name.
    """

    name: str
    op: str
    module: str
    start_us: float
    dur_us: float
    device: str
    lane: str


@dataclasses.dataclass(frozen=True)
class Step:
    """A ``StepTraceAnnotation``: its step number and host-side span (us)."""

    step_num: int
    start_us: float
    end_us: float


@dataclasses.dataclass
class Trace:
    """Kernels and steps of one trace file.

    platform: "gpu" when the trace has GPU planes, else "cpu".
    devices: the device (process) names that ran kernels, sorted.
    """

    path: str
    platform: str
    kernels: list[KernelEvent]
    steps: list[Step]
    devices: list[str]


def find_trace_file(log_dir: str | os.PathLike) -> Path:
    """The newest ``*.trace.json.gz`` that ``jax.profiler.trace(log_dir)`` wrote.

    Raises:
      FileNotFoundError: no trace under ``log_dir/plugins/profile``.
    """
    runs = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"),
                  key=lambda p: (p.stat().st_mtime, str(p)))
    if not runs:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    return runs[-1]


def read_events(path: str | os.PathLike) -> list[dict]:
    """The ``traceEvents`` list of a Chrome trace (.json or .json.gz).

    Raises:
      ValueError: the file is not a Chrome trace JSON.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return events


def _names(events):
    """(pid -> process name, (pid, tid) -> thread name) from the metadata events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        name = e.get("args", {}).get("name")
        if e.get("name") == "process_name":
            procs[e.get("pid")] = name or ""
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = name or ""
    return procs, threads


def _gpu_lanes(procs, threads):
    """(pid, tid) of the GPU stream lines; all non-derived lines if none is named 'Stream'."""
    gpu_pids = {pid for pid, name in procs.items() if GPU_PROCESS.match(name)}
    lanes = {k for k in threads if k[0] in gpu_pids}
    streams = {k for k in lanes if threads[k].startswith("Stream")}
    if streams:
        return streams
    return {k for k in lanes if threads[k] not in DERIVED_LINES}


def _is_cpu_op(event):
    args = event.get("args", {})
    # "end: <op>" marks the completion callback of an async thunk, not work.
    return "hlo_op" in args and not event.get("name", "").startswith("end: ")


def _op_text(args):
    parts = []
    for key in OP_ARGS:
        value = str(args.get(key, ""))
        if value and value not in parts:
            parts.append(value)
    return " ".join(parts)


def _exclusive(events):
    """Exclusive duration of each event on one CPU thread: its duration minus its children's.

    A child lies entirely inside its parent; an event that only overlaps the
    one before it is not its child and keeps its full duration.
    """
    order = sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"]))
    excl = [float(e["dur"]) for e in events]
    stack = []

    def end(i):
        return events[i]["ts"] + events[i]["dur"]

    for i in order:
        while stack and end(stack[-1]) < end(i):
            stack.pop()
        if stack:
            excl[stack[-1]] -= float(events[i]["dur"])
        stack.append(i)
    return [max(0.0, x) for x in excl]


def _steps(events):
    steps = []
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "X" and "step_num" in args:
            try:
                num = int(args["step_num"])
            except (TypeError, ValueError):
                continue
            steps.append(Step(num, float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return sorted(steps, key=lambda s: (s.start_us, s.step_num))


def parse_events(events: list[dict], path: str = "<events>") -> Trace:
    """Kernels and steps from Chrome trace events (see the module docstring).

    GPU traces: every complete event on a GPU stream line. CPU traces (no GPU
    plane): every host event with an ``hlo_op`` arg, with exclusive durations.
    """
    procs, threads = _names(events)
    gpu = _gpu_lanes(procs, threads)
    platform = "gpu" if any(GPU_PROCESS.match(n) for n in procs.values()) else "cpu"
    by_lane = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        lane = (e.get("pid"), e.get("tid"))
        if (platform == "gpu" and lane in gpu) or (platform == "cpu" and _is_cpu_op(e)):
            by_lane[lane].append(e)
    kernels = []
    for lane, lane_events in by_lane.items():
        # Only XLA:CPU nests ops (control-flow thunks around their bodies).
        excl = (_exclusive(lane_events) if platform == "cpu"
                else [float(e["dur"]) for e in lane_events])
        for e, dur in zip(lane_events, excl):
            args = e.get("args", {})
            kernels.append(KernelEvent(
                name=str(e.get("name", "")),
                op=_op_text(args),
                module=str(args.get("hlo_module", "")),
                start_us=float(e["ts"]),
                dur_us=dur,
                device=procs.get(lane[0], str(lane[0])),
                lane=threads.get(lane, str(lane[1])),
            ))
    kernels.sort(key=lambda k: (k.start_us, k.device, k.lane))
    devices = sorted({k.device for k in kernels})
    return Trace(str(path), platform, kernels, _steps(events), devices)


def load_trace(path: str | os.PathLike) -> Trace:
    """Parse a trace file, or the newest trace under a ``jax.profiler`` log dir.

    Raises:
      FileNotFoundError: no such file, or no trace under the directory.
      ValueError: not a Chrome trace.
    """
    path = Path(path)
    if path.is_dir():
        path = find_trace_file(path)
    return parse_events(read_events(path), str(path))
