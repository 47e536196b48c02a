#!/usr/bin/env bash
# The verifier engine on a GPU host: the architecture matrix and the captured passes on its backend, then
# `speclane bench device` (its arguments: this script's), then the start-up check of Qwen3-8B's shape with and
# without graphs and FlexAttention (reference_checks.py).
# Run from the repository root. A host without our pure-Python dependencies (an offline GPU image with its
# own torch) gets them from .device/, which prepare.sh beside this file fills elsewhere.
# TEST_TIMEOUT, BENCH_TIMEOUT and CHECK_TIMEOUT (seconds) bound the three parts; 0 skips one.
set -uo pipefail
out=${OUT:-docs/benchmarks/device/latest}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -f .device/site.tar.xz ]; then
  tar -xJf .device/site.tar.xz -C /tmp || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
[ -d .device/home ] && export SPECLANE_HOME=$PWD/.device/home
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$out/host.txt"
# Our C++ extensions for this Python: the drafter's suffix trees (--stack serves through them) and the CPU kernels
# (the matrix also runs some CPU rows). About 45 s on one core; the two build side by side.
python3 setup.py -q build_ext --inplace -j 2 > /tmp/build.log 2>&1 || { tail /tmp/build.log; exit 1; }
# Where pytest-xdist is installed, 8 workers: each test compiles its own Triton kernels, on the host's cores. Each
# worker compiles in its own process: inductor's default pool of a compiler process per core in each of 8 workers
# (128 processes importing torch on 16 cores) ran 2 tests in 110 s on the H200 host.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
[ "${TEST_TIMEOUT:-150}" != 0 ] && env SPECLANE_TEST_DEVICE="$device" ${workers:+TORCHINDUCTOR_COMPILE_THREADS=1} \
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m "not e2e" $workers --tb=short \
  tests/verifier/test_graphs.py tests/verifier/test_architectures.py 2>&1 | tee "$out/architectures.log"
[ "${BENCH_TIMEOUT:-420}" != 0 ] && timeout "${BENCH_TIMEOUT:-420}" python3 -m speclane_cli bench device \
  --device "$device" --json "$out/device.json" --profile "$out/profile-" "$@" 2>&1 \
  | grep -v "it/s\]" | tee "$out/bench.log"
[ "${CHECK_TIMEOUT:-90}" != 0 ] && timeout "${CHECK_TIMEOUT:-90}" python3 docs/benchmarks/device/reference_checks.py \
  --device "$device" 2>&1 | grep -v "it/s\]" | tee "$out/reference-checks.log"
exit 0
