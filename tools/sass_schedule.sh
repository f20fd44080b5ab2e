#!/usr/bin/env bash
# Where ptxas put a Mosaic GPU kernel's wgmma instructions: compile a PTX file
# (MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR writes them, on the GPU machine or on any
# host through `python -m dropless.perf.gpu_compile PROG.py`, which compiles for an H200) for
# sm_90a with the local ptxas, disassemble it with cuobjdump, and print each
# QGMMA/HGMMA, wgmma wait, fence and barrier wait of the kernel with the number of
# instructions since the previous one. A step whose four k32 wgmmas are far apart
# keeps the tensor cores waiting (benchmarks/notes/fp8.md, 2026-12-03 midday).
#
#   tools/sass_schedule.sh KERNEL.ptx [KERNEL.sass]
#
# Needs ptxas (the CUDA toolkit) and cuobjdump with nvdisasm beside it, taken from
# $CUOBJDUMP, from PATH, or from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
# wheels, unpacked once into ~/.cache/dropless-cuda. The GPU machine lacks nvdisasm;
# this runs on any host.
set -eu
ptx=${1:?usage: tools/sass_schedule.sh KERNEL.ptx [KERNEL.sass]}
sass=${2:-${ptx%.ptx}.sass}
command -v ptxas >/dev/null || { echo "sass_schedule: ptxas not found (CUDA toolkit)" >&2; exit 2; }
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ -z "$cuobjdump" ]; then
  cache=~/.cache/dropless-cuda
  cuobjdump=$(find "$cache" -name cuobjdump -type f 2>/dev/null | head -1)
  if [ -z "$cuobjdump" ]; then
    mkdir -p "$cache"
    python3 -m pip download -q --no-deps -d "$cache" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm \
      >/dev/null || { echo "sass_schedule: cuobjdump not found and its wheels did not download" >&2
                      exit 2; }
    (cd "$cache" && for w in nvidia_cuda_*.whl; do python3 -m zipfile -e "$w" .; done)
    cuobjdump=$(find "$cache" -name cuobjdump -type f | head -1)
    chmod +x "$(dirname "$cuobjdump")"/*
  fi
fi
export PATH="$(dirname "$cuobjdump"):$PATH"  # cuobjdump runs nvdisasm
cubin=$(mktemp --suffix .cubin)
trap 'rm -f "$cubin"' EXIT
ptxas -arch=sm_90a -O3 "$ptx" -o "$cubin"
"$cuobjdump" -sass "$cubin" >"$sass"
awk '/\/\*[0-9a-f]+\*\//{n++}
     /GMMA|WARPGROUP\.DEPBAR|WARPGROUP\.ARRIVE|MEMBAR|SYNCS\.PHASECHK/ {
       line=$0; sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, "", line); sub(/ *;.*/, "", line)
       printf "%5d since the previous | %s\n", n-last, line; last=n }' "$sass"
echo "(full SASS: $sass)"
