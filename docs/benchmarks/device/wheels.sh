#!/usr/bin/env bash
# Downloads, here (where the registry is reachable), the wheels an offline GPU host lacks for run.sh into .whl/
# (ignored by git; carried to the device), for CPython 3.12 on x86-64, the GPU image's Python. The image has
# torch, numpy, tokenizers, huggingface-hub, safetensors, accelerate, jinja2, httpx, prometheus-client, pyyaml,
# pybind11 and a C++ compiler. With --stack, also what `speclane serve` needs for its gateway and drafter (run.sh
# then builds our C++ extensions there). Versions: this repository's environment's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
wheels=(transformers==5.24.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
        protobuf==7.36.2 structlog==26.1.0)
if [ "${1:-}" = "--stack" ]; then
  wheels+=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
           annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.54.0
           llguidance==1.9.1 opentelemetry-api==1.45.2)
fi
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
du -sh .whl
