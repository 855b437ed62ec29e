#!/usr/bin/env bash
# Builds causal-conv1d's wheel (the CUDA convolution mamba_ssm's memory-efficient layer path needs) on the GPU
# machine from the source ../shared/device/prepare --peers carries (.device/causal_conv1d.tar.gz), for sm_90 only
# and with nvcc splitting each file's compilation over the cores (--split-compile=0): its setup.py builds about
# nine architectures, one file at a time per architecture, which did not finish in 270 s on 16 cores.
# Usage (after `source .device/env.sh`):  bash measure/build_causal_conv1d.sh OUT_DIR
# The wheel lands in OUT_DIR; copied into .device/wheels/ here, env.sh installs it on every later call.
set -euo pipefail
out=$(realpath "${1:?usage: build_causal_conv1d.sh OUT_DIR}")
src=$(realpath .device/causal_conv1d.tar.gz)
work=$(mktemp -d)
tar -C "$work" -xzf "$src"
cd "$work"/causal_conv1d-*
python3 - <<'PY'
s = open("setup.py").read()
anchor = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
assert anchor in s and '"--use_fast_math",' in s, "causal-conv1d's setup.py is not the one this script knows"
# after its architecture list is built: sm_90 only
s = s.replace(anchor, '    cc_flag = [f for f in cc_flag if f != "-gencode" and not f.startswith("arch=")]'
                      ' + ["-gencode", "arch=compute_90,code=sm_90"]\n' + anchor, 1)
s = s.replace('"--use_fast_math",', '"--use_fast_math", "--split-compile=0",', 1)
open("setup.py", "w").write(s)
PY
# the machine's own CUDA (the carried tileiras toolchain on PATH is for cuTile only)
CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-3} \
  python3 -m pip wheel --no-build-isolation --no-deps -w "$out" .
ls -la "$out"/causal_conv1d-*.whl
