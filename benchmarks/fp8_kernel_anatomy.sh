#!/usr/bin/env bash
# The anatomy of the FP8 grouped-GEMM kernels at one shape (the probe's default,
# M=65536 G=32 K=7168 N=4096, balanced; or PROBE_ARGS's): their SASS and PTX as Mosaic GPU
# compiled them, and one Nsight Compute launch of each with every section's raw
# metrics (instruction mix, stall reasons, pipe utilization). This is where the
# FP32 promotion's instruction count per step is read off (notes/fp8.md).
#
#   benchmarks/fp8_kernel_anatomy.sh OUT_DIR [product:variant:kernel-regex ...]
#
# Runs on the GPU machine (ncu locks the clocks to base, so its durations are
# not the benchmark's; fp8_kernel_probe.py gives those).
set -u
out=${1:?usage: fp8_kernel_anatomy.sh OUT_DIR [product:variant:kernel ...]}
shift
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(fwd:rows_gtw8:gmm_fp8 wgrad:wgrad_rows_overlap_sorted:tgmm_fp8)
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
pages=()
# PROBE_ARGS: the probe's shape and layout, e.g. "--shape 65536,256,7168,4096".
probe="python3 benchmarks/fp8_kernel_probe.py ${PROBE_ARGS:-}"
for spec in "${specs[@]}"; do
  IFS=: read -r product variant kernel <<<"$spec"
  mkdir -p "$out/sass-$variant"
  echo "== $product $variant: PTX (and SASS where nvdisasm is installed)"
  MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="$out/sass-$variant" \
    timeout 90 $probe --once "$variant" --product "$product" >"$out/sass-$variant/stdout.txt" 2>&1
  echo "   exit $?; $(ls "$out/sass-$variant" | wc -l) files"
  rm -f "$out/sass-$variant"/*.mlir-passes.log  # 15-25 MB each, every pass's IR
  echo "== $product $variant: ncu"
  timeout 120 "$ncu" --set full --import-source no -f -o "$out/ncu-$variant" -k "regex:^$kernel" \
    --launch-skip 2 --launch-count 1 $probe --once "$variant" --product "$product" \
    >"$out/ncu-$variant.log" 2>&1
  echo "   exit $?"
  "$ncu" -i "$out/ncu-$variant.ncu-rep" --page raw >"$out/ncu-$variant.txt" 2>&1
  pages+=("$product-$variant=$out/ncu-$variant.txt")
  "$ncu" -i "$out/ncu-$variant.ncu-rep" --page source --print-source sass --csv \
    >"$out/ncu-source-$variant.csv" 2>&1
  echo "   source page: $(wc -l <"$out/ncu-source-$variant.csv") lines"
  gzip -f "$out/ncu-source-$variant.csv"
  rm -f "$out/ncu-$variant.ncu-rep"  # printed above; the file is large and needs ncu to read
  grep -E "inst_executed_op_ffma|inst_executed_op_fmul|inst_executed_op_fadd|smsp__inst_executed.sum |pipe_tensor.*pct|issue_active.avg.pct" \
    "$out/ncu-$variant.txt" | head -20
done
# The quoted figures as a results record (GPU, jax version, commit), in the parent of
# OUT_DIR: the folder the device tool brings back.
python3 benchmarks/ncu_summary.py --out "$(dirname "$out")" \
  --config "fp8_kernel_probe.py --once ${PROBE_ARGS:-(its default shape)}, ncu --set full" "${pages[@]}"
