#!/usr/bin/env bash
# Every GPU check in one go, each step under its own time limit, results under ${OUT:-gpu-results}/.
# Usage (on the GPU machine, after `source .device/env.sh`):  bash measure/run_all.sh [step ...]
# Steps: kernels memcheck check backward state_update conv_ops norm_ops layer_serving models model_bench profile
# (default: all, in order; layer_ops: the three between state_update and models in one step),
# and on request: check64 memcheck64 kernels64 (the same with the 64-bit-indexed kernels only, M2OPS_INDEX32=0),
# variants (measure/variants_scan.py), family_bench (every transformers family, m2ops.bench.model --family all),
# backward_memcheck, profile_table (docs/profiling.md's table),
# backward_profile (measure/backward_scan.py: the backward's time by kernel), host (measure/plan_cost.py --ladder:
# an eager forward's host time, step by step), op_times (measure/op_times.py), and the sweeps of
# docs/validation.md's next GPU run: decode (measure/decode_scan.py), forward_sweep (variants_scan.py), graph_sweep
# (graph_scan.py at 1K), backward_sweep (backward_scan.py): the occupancy hints of specialise._OCCUPANCY_ANY_CHUNK
# against none and against occupancy 8; conv_variants, norm_variants (the wide norm's backward in one pass
# against two), layer_memory (a training step's peak) and
# grad_assembly (the mixer backward's gradient buffers from their pieces); and the targets' benchmarks with their peers:
# serve_bench (m2ops.bench.serve), layer_bench (m2ops.bench.layer against mamba_ssm's layer, both paths),
# fwdbwd_bench (m2ops.bench --backward at 4K-64K), train_bench and train_bench_b8 (the same at 2K-8K, and at batch
# 8 x 4K), host_scan (measure/host_scan.py at 4K: host against device time); causal_conv1d (measure/build_causal_conv1d.sh: mamba_ssm's
# convolution built for sm_90 into $OUT, for its layer's memory-efficient path; beside the test suites with
# --parallel, since it needs the CPU only).
# LIMIT_<step>=seconds overrides a step's time limit. With --parallel first, the steps run side by side (for suites
# that need no timing: e.g. --parallel kernels backward state_update models, about 6 minutes on a fresh H200).
# The test steps tune into a tuning cache of their own, so that a benchmark run after them on the same machine
# does not read configurations searched while other suites shared the GPU.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
parallel=0
[ "${1:-}" = "--parallel" ] && { parallel=1; shift; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(kernels memcheck check backward state_update conv_ops norm_ops layer_serving models model_bench profile)
TEST_TUNING="M2OPS_TUNING_CACHE=${TMPDIR:-/tmp}/m2ops-gpu-tests-tuning.json"

run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local override="LIMIT_$name"; secs=${!override:-$secs}  # e.g. LIMIT_backward=200 shortens one step
  echo "=== $name (limit ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "    rc=$rc in $((SECONDS - t0))s; last lines:"
  tail -n 4 "$OUT/$name.txt" | sed 's/^/    /'
}

step() {
  local s=$1
  case $s in
    kernels) run kernels 420 env "$TEST_TUNING" python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_graph_safety.py ;;
    memcheck) run memcheck 200 env "$TEST_TUNING" PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/check_kernels.py --small ;;
    check) run check 240 env "$TEST_TUNING" python tests/gpu/check_kernels.py ;;
    backward) run backward 300 env "$TEST_TUNING" python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_backward_kernels.py tests/gpu/test_gradient_accuracy_gpu.py ;;
    state_update) run state_update 120 env "$TEST_TUNING" python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_state_update_kernel.py ;;
    # The layer's op suites, apart so that they can run side by side (--parallel): each hypothesis example of the
    # convolution's tests may JIT-build new specialisations (dtype, width, SiLU, channel count class), which is
    # what takes the time there (about 75 s for two examples of forward and backward on an H100).
    conv_ops) run conv_ops 420 env "$TEST_TUNING" python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_conv1d_kernel.py ;;
    norm_ops) run norm_ops 300 env "$TEST_TUNING" python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gated_norm_kernel.py ;;
    layer_serving) run layer_serving 300 env "$TEST_TUNING" python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_layer_mem_eff_gpu.py tests/gpu/test_varlen_serving_gpu.py ;;
    layer_ops) step conv_ops; step norm_ops; step layer_serving ;;
    models) run models 420 env "$TEST_TUNING" python -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_models_gpu.py ;;
    model_bench) run model_bench 240 python -m m2ops.bench.model --out "$OUT/model.json" ;;
    family_bench) run family_bench 580 python -m m2ops.bench.model --family all --out "$OUT/family.json" ;;
    profile) run profile 300 python measure/profile_scan.py --shapes 1K:128,4K:128,16K:128,64K:256 --json "$OUT/profile.json" ;;
    check64) run check64 240 env "$TEST_TUNING" M2OPS_INDEX32=0 python tests/gpu/check_kernels.py ;;
    memcheck64) run memcheck64 200 env "$TEST_TUNING" M2OPS_INDEX32=0 PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/check_kernels.py --small ;;
    kernels64) run kernels64 420 env "$TEST_TUNING" M2OPS_INDEX32=0 M2OPS_GPU_EXAMPLES=8 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_kernels.py ;;
    variants) run variants 240 python measure/variants_scan.py --shapes 16K:128,64K:256,4K:128 --json "$OUT/variants.json" ;;
    backward_memcheck) run backward_memcheck 300 env "$TEST_TUNING" PYTORCH_NO_CUDA_MEMORY_CACHING=1 M2OPS_GPU_EXAMPLES=2 compute-sanitizer --tool memcheck python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_backward_kernels.py ;;
    backward_profile) run backward_profile 240 python measure/backward_scan.py --shapes 4K:128,16K:128,64K:128 --json "$OUT/backward_profile.json" ;;
    profile_table) run profile_table 180 python -m m2ops.bench.profile --backward --rows 30 ;;
    op_times) run op_times 300 python measure/op_times.py --json "$OUT/op_times.json" ;;
    host) run host 120 python measure/plan_cost.py --shapes 4K:64,1K:64 --ladder 7 ;;
    decode) run decode 150 python measure/decode_scan.py --json "$OUT/decode.json" ;;
    forward_sweep) run forward_sweep 300 python measure/variants_scan.py --shapes 64K:64,16K:128,64K:128,4K:64 \
        --variants "defaults,chunk_cb no occ,chunk_cb occ 8,defaults" \
        --json "$OUT/forward_sweep.json" ;;
    graph_sweep) run graph_sweep 180 python measure/graph_scan.py --shapes 1K:64,1K:256,1K:512 \
        --variants "defaults,chunk_cb no occ" --json "$OUT/graph_sweep.json" ;;
    backward_sweep) run backward_sweep 300 python measure/backward_scan.py --shapes 64K:128,16K:128,64K:64 \
        --variants "swept no occ,state_carry_grad occ 8,chunk_cumsum_bwd occ 2,chunk_cb occ 8" \
        --json "$OUT/backward_sweep.json" ;;
    # the layer's kernels and the serving corrections against their variants, and the training step's memory
    conv_variants) run conv_variants 150 python measure/conv_variants.py --tiles 16x64,8x128 --occupancy table,8 \
        --json "$OUT/conv_variants.json" ;;
    norm_variants) run norm_variants 150 python measure/norm_variants.py --backward --json "$OUT/norm_bwd_variants.json" ;;
    layer_memory) run layer_memory 90 python measure/layer_memory.py --json "$OUT/layer_memory.json" ;;
    grad_assembly) run grad_assembly 60 python measure/grad_assembly.py --json "$OUT/grad_assembly.json" ;;
    # the benchmarks the open issues' targets are measured by, both peers in the same run
    serve_bench) run serve_bench 240 python -m m2ops.bench.serve --runs 10 --out "$OUT/serve.json" ;;
    layer_bench) run layer_bench 420 python -m m2ops.bench.layer --shapes 8x4K,1x64K \
        --impls m2ops,mamba_ssm,mamba_ssm-memeff --modes forward,train,decode --decode-batches 1,64,256 --runs 5 \
        --warmup 1 --out "$OUT/layer.json" ;;
    fwdbwd_bench) run fwdbwd_bench 420 python -m m2ops.bench --backward --seqlens 4K,16K,64K --dstates 64,128,256 \
        --peers m2ops,mamba_ssm-c128,mamba_ssm-c256,tilegym --runs 10 --out "$OUT/fwdbwd" ;;
    # the training lengths (2K-8K, and batch 8 x 4K) with every peer and the gradients' errors (--check)
    train_bench) run train_bench 300 python -m m2ops.bench --backward --check --seqlens 4K,8K,2K --dstates 64,128,256 \
        --peers m2ops,m2ops-graph,mamba_ssm-c128,mamba_ssm-c256,tilegym --runs 10 --warmup 3 --out "$OUT/train" ;;
    train_bench_b8) run train_bench_b8 200 python -m m2ops.bench --backward --check --batch 8 --seqlens 4K \
        --dstates 64,128,256 --peers m2ops,m2ops-graph,mamba_ssm-c128,mamba_ssm-c256,tilegym --runs 10 --warmup 3 \
        --out "$OUT/train_b8" ;;
    host_scan) run host_scan 90 python measure/host_scan.py --shapes 4K:128,4K:64 --rows 15 ;;
    causal_conv1d) run causal_conv1d 560 bash measure/build_causal_conv1d.sh "$OUT" ;;
    *) echo "unknown step $s"; return 2 ;;
  esac
}

for s in "${steps[@]}"; do
  if [ $parallel = 1 ]; then step "$s" & else step "$s" || exit $?; fi
done
wait
