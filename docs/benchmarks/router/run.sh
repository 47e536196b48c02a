#!/bin/bash
# flock /tmp/speclane-bench.lock docs/benchmarks/router/run.sh
# One verifier, one drafter (no global tree: runs must not draft each other's answers), two gateways on them,
# smg (cache-aware) over the two; bench agent at 16 sessions alternately on gateway A alone and on the router.
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
OUT=${OUT:-docs/benchmarks/router} LOGS=${LOGS:-/tmp/router-bench}
mkdir -p "$LOGS"
M=${SPECLANE_HOME:-$HOME/.cache/speclane}/models/smollm2-135m-instruct
speclane drafter --address 127.0.0.1:52061 --max-cached-requests 0 --log-level warning > $LOGS/drafter.log 2>&1 &
speclane verifier --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:52062 --log-level warning > $LOGS/verifier.log 2>&1 &
sleep 3
for g in 1 2; do
  speclane gateway --model smollm2-135m-instruct --port 820$g --grpc-address 127.0.0.1:5207$g --drafter-address 127.0.0.1:52061 --verifier-addresses 127.0.0.1:52062 --log-level warning > $LOGS/gateway$g.log 2>&1 &
done
for i in $(seq 150); do curl -sf localhost:8201/health >/dev/null && curl -sf localhost:8202/health >/dev/null && break; sleep 2; done
smg launch --host 127.0.0.1 --port 8300 --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port 29110 --worker-urls http://127.0.0.1:8201 http://127.0.0.1:8202 > $LOGS/smg.log 2>&1 &
SMG=$!
for i in $(seq 60); do curl -sf localhost:8300/readiness >/dev/null && break; sleep 1; done
date -u
n=0
for target in direct router router direct direct router; do
  n=$((n+1))
  url=$([ $target = direct ] && echo http://127.0.0.1:8201 || echo http://127.0.0.1:8300)
  speclane bench agent --url $url --model smollm2-135m-instruct --sessions 16 --requests-per-session 3 --concurrency 16 --methods suffix --max-tokens 96 --temperature 0.0 --seed $(( (n+1)/2 )) --output-dir $OUT/run$n-$target > $LOGS/bench$n.log 2>&1
  echo "== run $n $target seed $(( (n+1)/2 ))"; grep "^| 16" $OUT/run$n-$target/results.md
done
date -u
kill $SMG; pkill -f "speclane gateway --model smollm2-135m-instruct --port 820"; pkill -f "address 127.0.0.1:5206"; wait
