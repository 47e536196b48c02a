#!/usr/bin/env bash
# The verifier engine on a GPU host: the architecture matrix and the captured passes on its backend, then
# `speclane bench device`.
# Run from the repository root. A host without our pure-Python dependencies (an offline GPU image with its
# own torch) gets them from wheels in .whl/, which wheels.sh beside this file downloads elsewhere.
set -uo pipefail
out=${OUT:-docs/benchmarks/device/latest}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$out/host.txt"
# Our C++ extensions for this Python: the drafter's suffix trees (--stack serves through them) and the CPU kernels
# (the matrix also runs some CPU rows). About 45 s on one core; the two build side by side.
python3 setup.py -q build_ext --inplace -j 2 > "$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
SPECLANE_TEST_DEVICE=$device timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m "not e2e" \
  --tb=short tests/verifier/test_graphs.py tests/verifier/test_architectures.py 2>&1 | tee "$out/architectures.log"
timeout "${BENCH_TIMEOUT:-420}" python3 -m speclane_cli bench device --device "$device" --json "$out/device.json" \
  --profile "$out/profile-" "$@" 2>&1 \
  | grep -v "it/s\]" | tee "$out/bench.log"
