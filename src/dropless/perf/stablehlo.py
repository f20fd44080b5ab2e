"""Where the kernels sit in a lowered (StableHLO) module, before XLA optimizes it.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` lowers a step for
the GPU on any machine, Mosaic GPU kernels included (they are ``stablehlo.custom_call
@mosaic_gpu_v2`` ops). ``kernel_calls`` lists each such call with the while
loops around it and the ops that read its result. That is what JAX hands to
XLA: a count here that differs from the optimized HLO's
(``tools/count_step_kernels.py``) is XLA's doing, and a kernel result read by
a ``dynamic_update_slice`` (a scan stacking it as a residual) and by other ops
as well is what XLA's GPU dynamic-slice fusion runs twice
(``benchmarks/notes/scan.md``).
"""

import itertools
from typing import NamedTuple


class KernelCall(NamedTuple):
    """One custom call of ``kernel_calls``.

    loops: the while loops around it, outermost first, each as its index among
      all the module's while ops in the order the walk meets them (calls
      followed into their functions); () outside any loop.
    users: the op name of each use of its (first) result, sorted, e.g.
      ``stablehlo.optimization_barrier``; a ``func.call`` as ``func.call @callee``.
    """

    loops: tuple
    users: tuple


def kernel_calls(module_text: str, target_prefix: str = "mosaic_gpu") -> list[KernelCall]:
    """The custom calls whose target starts with ``target_prefix`` in ``module_text``
    (a StableHLO module's text, e.g. ``Lowered.as_text()``), from ``main``
    through the functions it calls, in program order.

    Raises:
      ValueError: the module has no ``main`` function.
    """
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    module = ir.Module.parse(module_text, context=jax_mlir.make_ir_context())
    funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op
             for op in module.body.operations if "sym_name" in op.attributes}
    if "main" not in funcs:
        raise ValueError(f"no main function in the module; functions: {sorted(funcs)}")
    out, whiles = [], itertools.count()

    def user(use) -> str:
        owner = use.owner
        if owner.name == "func.call":
            return f"func.call @{ir.FlatSymbolRefAttr(owner.attributes['callee']).value}"
        return owner.name

    def walk(op, loops):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    name = inner.operation.name
                    if name == "stablehlo.custom_call":
                        target = ir.StringAttr(inner.attributes["call_target_name"]).value
                        if target.startswith(target_prefix):
                            users = sorted(user(u) for u in inner.results[0].uses)
                            out.append(KernelCall(loops, tuple(users)))
                    elif name == "func.call":
                        walk(funcs[ir.FlatSymbolRefAttr(inner.attributes["callee"]).value], loops)
                    elif name == "stablehlo.while":
                        walk(inner, (*loops, next(whiles)))
                    else:
                        walk(inner, loops)

    walk(funcs["main"], ())
    return out
