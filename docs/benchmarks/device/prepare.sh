#!/usr/bin/env bash
# Prepares, here (where the registry is reachable), what an offline GPU host lacks for run.sh, in .device/
# (ignored by git; carried to the device):
#   site.tar.xz  the contents of the wheels the GPU image lacks, for its CPython 3.12 on x86-64 (ARCH and
#                PYTHON_VERSION choose another host's). The image has torch, numpy, tokenizers, huggingface-hub,
#                safetensors, accelerate, jinja2, httpx, prometheus-client, pyyaml, pybind11 and a C++ compiler.
#                Unpacked and xz-compressed because the wheels themselves (26 MB, zip) and the tracked tree
#                (40 MB) pass the 64 MiB a device call carries.
#   tokenizer/   SmolLM2's tokenizer, which the random models get when --stack serves them;
#   home/        a SPECLANE_HOME holding the HumanEval prompts that --stack sends.
# With --stack, also what `speclane serve` needs for its gateway and drafter. Versions: this repository's
# environment's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
wheels=(transformers==5.24.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
        protobuf==7.36.2 structlog==26.1.0)
if [ "${1:-}" = "--stack" ]; then
  wheels+=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
           annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.54.0
           llguidance==1.9.1 opentelemetry-api==1.45.2)
fi
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
arch=${ARCH:-x86_64}  # aarch64 for an Atlas host's Kunpeng processors
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp --platform "manylinux_2_31_$arch" --platform "manylinux_2_28_$arch" \
  --platform "manylinux_2_27_$arch" --platform "manylinux_2_24_$arch" --platform "manylinux_2_17_$arch" \
  --platform "manylinux2014_$arch" -d "$staging/wheels" "${wheels[@]}"
# A wheel unpacked is an installed package (none of these has a .data folder or needs an entry point here).
for wheel in "$staging"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$staging/site"; done
mkdir -p .device
tar -cJf .device/site.tar.xz -C "$staging" site
models=${SPECLANE_HOME:-$HOME/.cache/speclane}
mkdir -p .device/tokenizer .device/home/datasets/humaneval
cp "$models"/models/smollm2-135m-instruct/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} \
  .device/tokenizer/
cp "$models"/datasets/humaneval/HumanEval.jsonl.gz .device/home/datasets/humaneval/
du -sh .device
