#!/bin/bash
# `speclane serve` (SmolLM2-135M, every other default) with --dtype float32 and with --dtype auto (bf16 on a CPU
# with AVX512-BF16 or AMX), alternated twice, each measured by the same `speclane bench serve`; the four tables go
# to docs/benchmarks/bf16/default-dtype/. Both cores; run it alone:
#     flock /tmp/speclane-bench.lock docs/benchmarks/bf16/default_dtype.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/benchmarks/bf16/default-dtype
port=8127
for pass in 1 2; do
  for dtype in float32 auto; do
    .venv/bin/speclane serve smollm2-135m-instruct --port $port --dtype $dtype > "/tmp/default-dtype-$dtype-$pass.log" 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 0.5; done
    .venv/bin/speclane bench serve --url http://127.0.0.1:$port --dataset sharegpt,humaneval,agent-loop,code-edit \
      --concurrency 1,16 --num-prompts 4 --max-turns 2 --methods none,suffix --max-tokens 128 --rounds 1 \
      --seed 2026 --output-dir "$out/$dtype-$pass"
    kill -INT $server
    wait $server || true
  done
done
