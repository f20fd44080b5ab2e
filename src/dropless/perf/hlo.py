"""What the optimized HLO says about each kernel: its op name and whether it writes FP8.

A profiler trace names each GPU kernel after the HLO instruction it runs
(``loop_convert_fusion.3`` runs as kernel ``loop_convert_fusion_3``), but
kernels inside XLA command buffers (CUDA graphs, on by default) carry the
command buffer's name as their op, not the jax op-name stack, and a fusion's
name never says its dtype. The optimized HLO, which ``dropless profile``
dumps with ``--xla_dump_to``, has both: each instruction's result type and its
``metadata={op_name="..."}``. ``kernel_ops`` turns a dump into extra op text
per kernel name for ``breakdown.compute``:

- the instruction's jax op name (so ``ops.quant``'s ``fp8_quantize`` scope
  shows even for kernels in CUDA graphs);
- ``breakdown.F8_RESULT_TAG`` when a non-GEMM instruction (a loop or input
  fusion, or a bare convert) has an FP8 result: a quantization's convert.
  GEMMs (custom calls such as ``__cublas$lt$matmul$f8``, ``kCustom`` Triton
  GEMM fusions) are never tagged, even when cuBLASLt writes FP8 itself.
"""

import os
import re
from pathlib import Path
from typing import Iterator, NamedTuple

F8_TYPE = re.compile(r"\bf8e\w+\[")
OP_NAME = re.compile(r'op_name="([^"]*)"')
CUSTOM_CALL_TARGET = re.compile(r'\bcustom_call_target="([^"]*)"')
FUSION_KIND = re.compile(r"\bkind=(k\w+)")
TAGGED_OPCODES = frozenset({"fusion", "convert"})
# "[ROOT] %name = " then the result type, the opcode and its operand list.
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")  # "[ENTRY] %name (params) -> type {"


class Instruction(NamedTuple):
    """One instruction of HLO text (``instructions``).

    name: without ``%``; type: result type (a tuple type keeps its parentheses);
    opcode: e.g. ``fusion``, ``custom-call``; operands: ``(inline type or None,
    name)`` each (the GPU's optimized HLO prints operands by name only, other
    printers as ``f8e4m3fn[8,16]{1,0} %a``); attrs: the text after the operand
    list (``kind=``, ``custom_call_target=``, ``metadata=``); scope: the names
    defined so far in the instruction's computation -> their result types;
    computation: that computation's name (without ``%``; "" before any header);
    root: it is that computation's ``ROOT``.
    """

    name: str
    type: str
    opcode: str
    operands: list
    attrs: str
    scope: dict
    computation: str = ""
    root: bool = False

    @property
    def custom_call_target(self) -> str | None:
        """A custom-call's ``custom_call_target`` (e.g. ``__cublas$lt$matmul$f8``); else None."""
        if self.opcode != "custom-call":
            return None
        m = CUSTOM_CALL_TARGET.search(self.attrs)
        return m.group(1) if m else None

    @property
    def result_types(self) -> list[str]:
        """The result's type, or each element's of a tuple result (a cuBLAS GEMM returns
        ``(bf16[M,N]{1,0}, s8[workspace]{0})``: its output first)."""
        if self.type.startswith("("):
            return _split_top(self.type[1:-1])
        return [self.type]

    @property
    def operand_types(self) -> list[str]:
        """Each operand's type: printed inline, else its definition's in the
        instruction's computation (``scope``), else ""."""
        return [inline or self.scope.get(name, "") for inline, name in self.operands]


def _balanced(text: str, i: int) -> int:
    """Index just past the bracket group that opens at ``text[i]`` (``(``, ``[`` or ``{``)."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "([{":
            depth += 1
        elif text[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside any brackets, each part stripped."""
    parts, depth, last = [], 0, 0
    for j, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[last:j].strip())
            last = j + 1
    parts.append(text[last:].strip())
    return [p for p in parts if p]


def instructions(text: str) -> Iterator[Instruction]:
    """Each instruction of HLO text, in order; ``/*index=5*/`` comments dropped.

    The one HLO text parser of dropless: ``parse`` (the profile's kernel op text),
    the FP8 dot count of ``benchmarks/fp8_dense.py`` (through
    ``Instruction.custom_call_target`` and ``Instruction.operand_types``),
    ``benchmarks/ep_overhead.py``'s instruction count and
    ``tools/count_step_kernels.py``'s Mosaic calls per computation read its
    instructions.
    """
    scope, computation = {}, ""
    for line in text.splitlines():
        m = _DEF.match(line)
        if not m:
            if line.rstrip().endswith("{"):  # a computation's header: a new name scope
                scope = {}
                if header := _HEADER.match(line):
                    computation = header.group(1)
            continue
        line = _COMMENT.sub("", line)
        m = _DEF.match(line)
        i = m.end()
        end = _balanced(line, i) if line[i:i + 1] == "(" else line.find(" ", i)
        end = len(line) if end < 0 else end
        type_ = line[i:end]
        scope[m.group(1)] = type_
        op = _OPCODE.match(line, end)
        if not op:
            continue
        close = _balanced(line, op.end() - 1)
        operands = []
        for part in _split_top(line[op.end():close - 1]):
            inline, _, name = part.rpartition(" ")
            operands.append((inline.strip() or None, name.lstrip("%")))
        yield Instruction(m.group(1), type_, op.group(1), operands, line[close:], scope, computation,
                          line.lstrip().startswith("ROOT "))


def parse(text: str, f8_tag: str = "f8_result") -> dict[str, str]:
    """Instruction name -> op text ("<op_name> [f8_tag]") for every instruction in ``text``.

    Both spellings of a name are keys: the HLO one (``fusion.3``) and the
    kernel one (``fusion_3``, dots and dashes as underscores).
    """
    ops = {}
    for inst in instructions(text):
        kind = FUSION_KIND.search(inst.attrs)
        words = []
        if m := OP_NAME.search(inst.attrs):
            words.append(m.group(1))
        if (inst.opcode in TAGGED_OPCODES and F8_TYPE.search(inst.type)
                and (kind is None or kind.group(1) != "kCustom")):
            words.append(f8_tag)
        if words:
            ops[inst.name] = ops[re.sub(r"[.\-]", "_", inst.name)] = " ".join(words)
    return ops


def module_name(text: str) -> str:
    """The module's name from its ``HloModule <name>, ...`` header ("" if none)."""
    m = re.search(r"^HloModule ([^\s,]+)", text, re.MULTILINE)
    return m.group(1) if m else ""


def entry_name(text: str) -> str:
    """The ``ENTRY`` computation's name, without ``%`` ("" if none): ``Instruction.computation``
    of the entry's instructions."""
    m = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.MULTILINE)
    return m.group(1) if m else ""


_CALLEES = re.compile(r"\b(calls|to_apply|body|condition|called_computations|branch_computations)="
                      r"(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r"known_trip_count[^0-9]*(\d+)")


def callees(inst: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation name) of each computation ``inst`` calls: ``calls``,
    ``to_apply``, a while loop's ``body`` and ``condition``, ``called_computations``,
    ``branch_computations``."""
    return [(key, name) for key, names in _CALLEES.findall(inst.attrs)
            for name in re.findall(r"%?([\w.\-]+)", names)]


def executions(insts: list[Instruction]) -> dict[str, int]:
    """Computation name -> how often it runs per run of the module, from the call graph.

    A computation runs as often as all its call sites' computations together, times the
    known trip count where it is a while loop's body (1 where XLA knows none), so a kernel
    in a fusion inside a loop inside a loop counts both loops. The entry (and anything
    nothing calls) runs once.
    """
    callers: dict[str, list[tuple[str, int]]] = {}
    for inst in insts:
        trips = 1
        if inst.opcode == "while" and (n := _TRIP_COUNT.search(inst.attrs)):
            trips = int(n.group(1))
        for key, callee in callees(inst):
            callers.setdefault(callee, []).append((inst.computation, trips if key == "body" else 1))
    runs: dict[str, int] = {}

    def count(comp: str, depth: int = 0) -> int:
        if comp not in runs:
            sites = callers.get(comp)
            runs[comp] = 1 if not sites or depth > 64 else sum(
                count(c, depth + 1) * t for c, t in sites)
        return runs[comp]

    for comp in {inst.computation for inst in insts}:
        count(comp)
    return runs


def inner_computations(insts: list[Instruction]) -> set[str]:
    """Names of the computations that run inside another instruction's kernel, not as
    kernels of their own: a fusion's fused computation (an async fusion's too), a
    reduction's, scatter's or sort's ``to_apply``, and whatever those call in turn."""
    calls: dict[str, list[str]] = {}
    inner = set()
    for inst in insts:
        for key, callee in callees(inst):
            calls.setdefault(inst.computation, []).append(callee)
            if key == "to_apply" or (key == "calls" and inst.opcode in ("fusion", "fusion-start")):
                inner.add(callee)
    todo = list(inner)
    while todo:
        for callee in calls.get(todo.pop(), []):
            if callee not in inner:
                inner.add(callee)
                todo.append(callee)
    return inner


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")


def collectives(insts: list[Instruction]) -> dict[str, tuple[int, int]]:
    """Collective kind (``COLLECTIVES``) -> (runs per run of the module, of them asynchronous:
    a ``-start`` / ``-done`` pair or an ``async-start`` wrapping it, which XLA can overlap with
    the work scheduled between the halves), counted through the call graph (``executions``)."""
    runs = executions(insts)
    wrapped = {callee for inst in insts if inst.opcode == "async-start" for _, callee in callees(inst)}
    out: dict[str, list[int]] = {}
    for inst in insts:
        kind = inst.opcode.removesuffix("-start")
        if kind in COLLECTIVES:
            n = out.setdefault(kind, [0, 0])
            n[0] += runs[inst.computation]
            if inst.opcode.endswith("-start") or inst.computation in wrapped:
                n[1] += runs[inst.computation]
    return {k: (n[0], n[1]) for k, n in out.items()}


# Instructions that launch nothing themselves (``launches``): bookkeeping, and control flow
# and ``async-start`` wrappers (what they call is counted where it runs).
NO_LAUNCH = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
                       "call", "conditional", "async-start", "after-all", "partition-id",
                       "replica-id"})


def launches(insts: list[Instruction]) -> list[Instruction]:
    """The instructions that launch work of their own (fusions, custom calls, copies,
    collectives, ...): not those inside a fusion or reduction (``inner_computations``), not a
    while loop's condition, not bookkeeping, control flow or an ``async-start`` wrapper
    (``NO_LAUNCH``; the instruction it wraps counts), not the ``-done`` half of an async pair."""
    skip = inner_computations(insts) | {c for i in insts for key, c in callees(i) if key == "condition"}
    return [i for i in insts if i.computation not in skip
            and i.opcode not in NO_LAUNCH and not i.opcode.endswith("-done")]


def _collective_kind(inst: Instruction, wrapped_kinds: dict[str, str]) -> str | None:
    kind = inst.opcode.removesuffix("-start")
    if kind in COLLECTIVES:
        return kind
    if inst.opcode == "async-start":
        return next((wrapped_kinds[c] for _, c in callees(inst) if c in wrapped_kinds), None)
    return None


def overlap(insts: list[Instruction]) -> dict[str, list[int]]:
    """Asynchronous collective kind -> for each run of each of them, the compute kernels XLA
    scheduled between its start and its done: the work it can overlap with.

    Reads a scheduled module (``is_scheduled=true``, as XLA's optimized HLO is), whose text
    lists each computation's instructions in schedule order. Kernels are ``launches`` that
    are not collectives themselves; a pair inside a loop body counts once per iteration.
    """
    runs = executions(insts)
    wrapped_kinds = {i.computation: i.opcode for i in insts if i.opcode in COLLECTIVES}
    launched = {(i.computation, i.name) for i in launches(insts)}
    out: dict[str, list[int]] = {}
    open_: dict[tuple[str, str], tuple[str, int]] = {}  # (computation, start) -> (kind, kernels)
    for inst in insts:
        done = inst.opcode.endswith("-done")
        if done:
            for _, name in inst.operands:
                if (key := (inst.computation, name)) in open_:
                    kind, n = open_.pop(key)
                    out.setdefault(kind, []).extend([n] * runs[inst.computation])
        kind = _collective_kind(inst, wrapped_kinds)
        if kind and inst.opcode.endswith("-start"):
            open_[(inst.computation, inst.name)] = (kind, 0)
        elif not done and kind is None and (inst.computation, inst.name) in launched:
            for key, (open_kind, n) in open_.items():
                if key[0] == inst.computation:
                    open_[key] = (open_kind, n + 1)
    return out


def kernel_ops(dump_dir: str | os.PathLike, f8_tag: str = "f8_result") -> dict[str, dict]:
    """HLO module name -> ``parse`` of it, for every ``*after_optimizations.txt`` under an
    ``--xla_dump_to`` dir (the trace's kernels name their module: ``KernelEvent.module``).

    Returns {} when there is no such file (the dump was not asked for).
    """
    ops = {}
    for path in sorted(Path(dump_dir).rglob("*after_optimizations.txt")):
        text = path.read_text(errors="replace")
        ops.setdefault(module_name(text), {}).update(parse(text, f8_tag))
    return ops
