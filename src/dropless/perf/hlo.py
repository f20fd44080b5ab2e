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

F8_TYPE = re.compile(r"\bf8e\w+\[")
OP_NAME = re.compile(r'op_name="([^"]*)"')
FUSION_KIND = re.compile(r"\bkind=(k\w+)")
TAGGED_OPCODES = frozenset({"fusion", "convert"})


def _split_type(rhs: str) -> tuple[str, str]:
    """(result type, the rest) of an instruction's right-hand side; tuple types nest."""
    if not rhs.startswith("("):
        head, _, rest = rhs.partition(" ")
        return head, rest
    depth = 0
    for i, ch in enumerate(rhs):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rhs[: i + 1], rhs[i + 1:].lstrip()
    return rhs, ""


def parse(text: str, f8_tag: str = "f8_result") -> dict[str, str]:
    """Instruction name -> op text ("<op_name> [f8_tag]") for every instruction in ``text``.

    Both spellings of a name are keys: the HLO one (``fusion.3``) and the
    kernel one (``fusion_3``, dots and dashes as underscores).
    """
    ops = {}
    for line in text.splitlines():
        line = line.strip().removeprefix("ROOT ")
        name, sep, rhs = line.partition(" = ")
        if not sep or " " in name or not name:
            continue
        rtype, rest = _split_type(rhs)
        opcode = rest.partition("(")[0]
        kind = FUSION_KIND.search(rest)
        words = []
        if m := OP_NAME.search(rest):
            words.append(m.group(1))
        if (opcode in TAGGED_OPCODES and F8_TYPE.search(rtype)
                and (kind is None or kind.group(1) != "kCustom")):
            words.append(f8_tag)
        if words:
            name = name.removeprefix("%")
            ops[name] = ops[re.sub(r"[.\-]", "_", name)] = " ".join(words)
    return ops


def module_name(text: str) -> str:
    """The module's name from its ``HloModule <name>, ...`` header ("" if none)."""
    m = re.search(r"^HloModule ([^\s,]+)", text, re.MULTILINE)
    return m.group(1) if m else ""


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
