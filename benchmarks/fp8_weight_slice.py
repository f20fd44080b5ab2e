"""Does XLA read one layer's slice of the stacked expert weights in place for the weight quantizer?

Legend: L layers, G groups, K x N the weight dims; the model stores the experts'
weights stacked [L, G, K, N] and each layer slices ``w[l]``.

In the FP8 step (``benchmarks/notes/fp8_hlo.md``, Q2) each layer's slice was
copied out of the stacked parameter (``wrapped_slice``, 3.95 ms per step) before
the Triton weight quantizer (``fp8_quant_kernels.quantize_weight``), while XLA
wrapped the Mosaic GPU GEMMs reading the same kind of slice in a dynamic-slice
fusion (in place). This compiles, for the Mosaic GPU weight quantizer
(``fp8_quant_mgpu``) and the Triton one as the control, at w [L, G, K, N] bf16
(default 3 x 32 x 7168 x 4096, DeepSeek-V3's gate|up stacked for 3 layers):

  static   ``quantize_weight(w[1])``              (the unrolled model's slice)
  dynamic  ``quantize_weight(w[i])``, i traced    (a dynamic-slice)
  scan     ``lax.scan`` over the layers quantizing each (the scanned model)

and reads each optimized HLO: ``in place`` where the quantizer's custom call
sits in a dynamic-slice fusion (``dynamic_slice_fusion``) or reads the stacked
parameter directly, ``copied`` where a slice, dynamic-slice or copy of it is
materialized first (the defining instruction is printed). It then times
``static`` against the quantizer on an unstacked [G, K, N] array (CUPTI and
wall clock): an in-place read costs nothing more. Writes the HLO texts and a
record ``fp8_weight_slice`` to ``--out``.

Run on the GPU machine:
  PYTHONPATH=src python3 benchmarks/fp8_weight_slice.py [--shape L,G,K,N] [--out DIR]
Exit status 1 if the Mosaic quantizer's static slice is not read in place.
"""

import argparse
import gzip
import os
import re
import statistics
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from dropless.ops.gmm import fp8_quant_kernels, fp8_quant_mgpu  # noqa: E402
from dropless.perf import hlo as hlo_lib  # noqa: E402
from dropless.perf import measure  # noqa: E402

IMPLS = {"mosaic": (fp8_quant_mgpu.quantize_weight, "mosaic_gpu_v2"),
         "triton": (fp8_quant_kernels.quantize_weight, "__gpu$xla.gpu.triton")}
_PASS_THROUGH = frozenset({"bitcast", "get-tuple-element", "reshape"})
_MATERIALIZE = frozenset({"slice", "dynamic-slice", "copy"})
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
# XLA's custom fusion around a call reading a slice in place: "dynamic_slice_fusion" in
# jax 0.11.2's XLA (the bf16 step's HLO), "(dynamic_)address_computation" in older ones.
_DYNAMIC_SLICE_FUSION = re.compile(r'"name":"(dynamic_slice_fusion|(dynamic_)?address_computation)"')


def cases(quantize):
    """name -> (fn of the stacked w, extra args)."""
    def scan(w):
        def body(total, w_l):
            return total + quantize(w_l)[-1].sum(), None
        return lax.scan(body, jnp.float32(0), w)[0]

    return {"static": (lambda w: quantize(w[1]), ()),
            "dynamic": (lambda w, i: quantize(lax.dynamic_index_in_dim(w, i, keepdims=False)),
                        (jnp.int32(1),)),
            "scan": (scan, ())}


def slice_verdict(hlo_text, target):
    """[(verdict, evidence)] for each custom call to ``target`` in optimized HLO text.

    verdict: ``"in place"`` (the call sits in a dynamic-slice fusion, or its bf16
    operand is a parameter of its computation, reached through bitcasts) or
    ``"copied"`` (that operand is materialized: a slice, dynamic-slice or copy, or a
    loop fusion whose root is one, as XLA's ``wrapped_slice``); ``"unknown"`` else.
    evidence: the HLO instruction (or fusion) that decided it, in short.
    """
    insts = list(hlo_lib.instructions(hlo_text))
    defs = {(i.computation, i.name): i for i in insts}
    roots = {i.computation: i for i in insts if i.root}
    callers = {callee: i for i in insts for callee in _CALLS.findall(i.attrs)}
    out = []
    for call in (i for i in insts if i.custom_call_target == target):
        fusion = callers.get(call.computation)
        if fusion is not None and _DYNAMIC_SLICE_FUSION.search(fusion.attrs):
            out.append(("in place", f"{call.name} inside dynamic-slice fusion {fusion.name}"))
            continue
        bf16 = [n for (_, n), t in zip(call.operands, call.operand_types) if t.startswith("bf16")]
        d = defs.get((call.computation, (bf16 or [call.operands[0][1]])[0]))
        while d is not None and d.opcode in _PASS_THROUGH:
            d = defs.get((call.computation, d.operands[0][1]))
        if d is None:
            out.append(("unknown", f"the operand of {call.name} is not defined in its computation"))
            continue
        called = _CALLS.findall(d.attrs) if d.opcode == "fusion" else []
        root = roots.get(called[0]) if called else None
        if d.opcode in _MATERIALIZE or (root is not None and root.opcode in _MATERIALIZE):
            verdict = "copied"
        else:
            verdict = "in place" if d.opcode == "parameter" else "unknown"
        via = f" (root {root.opcode})" if root is not None else ""
        out.append((verdict, f"{d.name} = {d.type} {d.opcode}{via} feeds {call.name}"))
    return out


def _cupti_ms(fn, args, iters):
    """Median summed kernel time of one call (ms), or None where CUPTI is unavailable."""
    try:
        return statistics.median(measure.cupti_kernel_ms(fn, *args, iters=iters))
    except Exception:  # noqa: BLE001 - no CUPTI
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="3,32,7168,4096", help="L,G,K,N")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    a = p.parse_args(argv)
    try:
        shape = tuple(int(d) for d in a.shape.split(","))
        if len(shape) != 4 or shape[0] < 2 or 0 in shape or shape[2] % 128 or shape[3] % 128:
            raise ValueError
    except ValueError:
        print(f"error: --shape {a.shape!r}: want L,G,K,N with L >= 2 and K, N multiples of 128",
              file=sys.stderr)
        return 2
    if jax.devices()[0].platform != "gpu":
        print("error: needs a CUDA GPU (the optimized HLO is XLA:GPU's)", file=sys.stderr)
        return 2
    record = measure.new_record("fp8_weight_slice", {"shape": list(shape), "iters": a.iters})
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    w = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    ok = True
    for impl, (quantize, target) in IMPLS.items():
        for case, (fn, extra) in cases(quantize).items():
            text = jax.jit(fn).lower(w, *extra).compile().as_text()
            path = out_dir / f"hlo-fp8-weight-slice-{impl}-{case}.txt.gz"
            with gzip.open(path, "wt") as f:
                f.write(text)
            verdicts = slice_verdict(text, target)
            for verdict, evidence in verdicts or [("unknown", f"no custom call to {target}")]:
                print(f"{impl:<7} {case:<8} {verdict:<9} {evidence}")
            record["rows"].append({"section": "hlo", "impl": impl, "case": case, "hlo": path.name,
                                   "verdicts": verdicts})
            if impl == "mosaic" and case == "static":
                ok = bool(verdicts) and all(v == "in place" for v, _ in verdicts)
        layer = jax.block_until_ready(w[1])
        for name, (f, args) in {"stacked w[1]": (jax.jit(lambda w: quantize(w[1])), (w,)),
                                "unstacked": (jax.jit(quantize), (layer,))}.items():
            kms = _cupti_ms(f, args, a.iters)
            wms = measure.time_fn(f, *args, warmup=2, iters=a.iters)["median_ms"]
            print(f"{impl:<7} {name:<14} kernel {kms or float('nan'):8.3f} ms   wall {wms:8.3f} ms")
            record["rows"].append({"section": "time", "impl": impl, "operand": name,
                                   "kernel_ms": kms, "wall_ms": wms})
        del layer
    print(f"\nrecord: {measure.write_record(record, a.out)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
