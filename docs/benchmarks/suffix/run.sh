#!/bin/bash
# Suffix decoding against n-gram lookup and transformers' generate(), each method at its default k, side by side
# in one run (docs/benchmarks/suffix/README.md). Prefix caching is off so that no method's prefill is served from an
# earlier method's cache; --rounds 2 runs every block twice, in reversed order the second time.
set -euo pipefail
out=${1:-docs/benchmarks/suffix}
speclane serve --no-enable-prefix-caching --port 8123 --grpc-port 50123 &
server=$!
trap 'kill $server; wait $server 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:8123/health >/dev/null; do sleep 2; done
speclane bench serve --url http://127.0.0.1:8123 --dataset humaneval,sharegpt,agent-loop,code-edit \
    --concurrency 1,4 --num-prompts 8 --max-turns 2 --methods none,ngram,suffix --rounds 2 \
    --peer hf-prompt-lookup --output-dir "$out"
