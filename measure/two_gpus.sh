#!/usr/bin/env bash
# Two command lists side by side on the two GPUs of one host (an nvidia-h200-x2 machine), each list on its
# own GPU with its own results folder, all of it stopped after a time limit; then the results are packed
# into one archive ($OUT/results.tgz), since the device returns at most 8 files.
# Usage (on the GPU machine, after `source .device/env.sh`):
#   LIMIT=540 bash measure/two_gpus.sh "<commands for GPU 0>" "<commands for GPU 1>"
# Each list runs under `bash -c` with CUDA_VISIBLE_DEVICES set and OUT=$OUT/g0 or $OUT/g1; its output goes to
# $OUT/g<i>/log.txt. Example:
#   bash measure/two_gpus.sh "bash measure/run_all.sh kernels backward" \
#       "python -m m2ops.bench --seqlens 64K --chunk-size 256 --check --out \$OUT/fwd"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-gpu-results}"
LIMIT="${LIMIT:-540}"
[ $# -eq 2 ] || { echo "usage: bash measure/two_gpus.sh \"<GPU 0 commands>\" \"<GPU 1 commands>\"" >&2; exit 2; }
mkdir -p "$OUT/g0" "$OUT/g1"
for i in 0 1; do
  cmds=$1; [ "$i" = 1 ] && cmds=$2
  CUDA_VISIBLE_DEVICES=$i OUT="$OUT/g$i" timeout "$LIMIT" bash -c "$cmds" > "$OUT/g$i/log.txt" 2>&1 &
done
wait
tar czf "$OUT/results.tgz" -C "$OUT" g0 g1 && rm -rf "$OUT/g0" "$OUT/g1"
tail -n 5 <(tar xzOf "$OUT/results.tgz" g0/log.txt) <(tar xzOf "$OUT/results.tgz" g1/log.txt) 2>/dev/null || true
