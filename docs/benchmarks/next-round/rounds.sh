# Shared by run.sh and side-by-side.sh (sourced): wait for the gateways, then the closed-loop bench
# against each in turn, round after round.
# usage: bench_rounds ROUNDS PORT...
bench_rounds() {
  local rounds=$1 port round
  shift
  for port in "$@"; do
    until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 2; done
  done
  echo ready
  for round in $(seq 1 $rounds); do
    for port in "$@"; do
      speclane bench serve --url http://127.0.0.1:$port --dataset code-edit --concurrency 1 --num-prompts 8 \
        --max-turns 1 --methods ${METHOD:-suffix} --max-tokens 128 --output-dir $OUT/out-$round-$port > bench-$round-$port.log 2>&1
      echo "round $round port $port done"
    done
  done
}
