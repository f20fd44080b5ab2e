#!/usr/bin/env bash
# The anatomy of the FP8 grouped-GEMM kernels at one shape (the probe's default,
# M=65536 G=32 K=7168 N=4096, balanced): their SASS and PTX as Mosaic GPU
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
[ ${#specs[@]} -gt 0 ] || specs=(fwd:rows_gtw8:gmm_fp8 wgrad:wgrad_rows_overlap_sorted:tgmm_fp8
                                 wgrad:wgrad_rows:tgmm_fp8)
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
probe="python3 benchmarks/fp8_kernel_probe.py"
for spec in "${specs[@]}"; do
  IFS=: read -r product variant kernel <<<"$spec"
  mkdir -p "$out/sass-$variant"
  echo "== $product $variant: SASS and PTX"
  MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="$out/sass-$variant" \
    timeout 90 $probe --once "$variant" --product "$product" >"$out/sass-$variant/stdout.txt" 2>&1
  echo "   exit $?; $(ls "$out/sass-$variant" | wc -l) files"
  echo "== $product $variant: ncu"
  timeout 120 "$ncu" --set full --page raw -k "regex:^$kernel" --launch-skip 2 --launch-count 1 \
    $probe --once "$variant" --product "$product" >"$out/ncu-$variant.txt" 2>&1
  echo "   exit $?"
  grep -E "inst_executed_op_ffma|inst_executed_op_fmul|inst_executed_op_fadd|smsp__inst_executed.sum |pipe_tensor.*pct|issue_active.avg.pct" \
    "$out/ncu-$variant.txt" | head -20
done
