#!/usr/bin/env bash
# One device call on the GPU machine: set up (the carried wheels, PYTHONPATH,
# the commit), then run each argument as a shell command in order, teeing its
# output to $OUT/<n>-<first word>.log and going on after a failure. Results
# JSONs the benchmarks write go to $OUT when they are given --out $OUT.
#
#   tools/gpu_run.sh "python3 -m pytest -q -m gpu tests/ops/test_fp8_quant_kernels.py" \
#                    "python3 benchmarks/fp8_quant.py --quick --out \$OUT"
#
# Needs: $OUT (the device tool sets it), .whl/ carried (make wheels here), and
# DROPLESS_COMMIT set by the caller to the commit being measured, as a literal
# sha expanded on this side: the GPU machine's copy of the tree can carry a
# stale git HEAD, so $(git rev-parse HEAD) evaluated there names the wrong
# commit (it did on 2026-12-02).
set -u
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder whose files come back}"
: "${DROPLESS_COMMIT:?set DROPLESS_COMMIT to the commit being measured}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/setup.log" 2>&1 \
  || echo "wheel install failed (see setup.log)"
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 DROPLESS_COMMIT OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
# The code this call runs, checkable here against the commit named (dropless.perf.provenance).
echo "commit $DROPLESS_COMMIT source $(python3 -m dropless.perf.provenance --digest 2>/dev/null \
  || echo unavailable)" | tee -a "$OUT/gpu.txt"
n=0
for cmd in "$@"; do
  n=$((n + 1))
  name=$(echo "$cmd" | awk '{print $2}' | tr -c 'A-Za-z0-9_.\n-' '_' | head -c 40)
  echo "=== [$n] $cmd"
  start=$(date +%s)
  bash -c "$cmd" 2>&1 | tee "$OUT/$n-$name.log" | tail -40
  echo "=== [$n] exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
done
# The device returns at most 8 files from $OUT, counted in its folders too, and
# none more than 2 folders down: the logs go back as one logs.tgz, and the rest
# too as results.tgz when more than 7 files remain or one lies deeper (unpack both here).
cd "$OUT" && tar czf logs.tgz --remove-files ./*.log gpu.txt 2>/dev/null
if [ "$(find . -mindepth 1 ! -type d ! -path ./logs.tgz | wc -l)" -gt 7 ] \
    || [ -n "$(find . -mindepth 4 ! -type d -print -quit)" ]; then
  # results.tgz left out of the list: tar creates it while find still lists (it
  # would archive itself and then remove itself).
  find . -maxdepth 1 -mindepth 1 ! -name logs.tgz ! -name results.tgz -printf '%P\n' \
    | tar czf results.tgz --remove-files -T -
fi
ls -l "$OUT"
