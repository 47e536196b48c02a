#!/bin/bash
# The verifier's own lookups on one host: two gateways over one drafter (global tree on) and one verifier,
# lookups "auto" (the default) on 8201 and "off" on 8203 (--speculation-debug; the results in README.md
# ran the key it replaced, next_round_lookup), benched alternately. Run from an activated venv.
# usage: CONCURRENCY=1 NUM_PROMPTS=8 DATASETS=sharegpt,humaneval,agent-loop,code-edit ROUNDS=2 OUT=DIR lookup-vs-wait.sh
M=~/.cache/speclane/models/smollm2-135m-instruct
OUT=${OUT:-/tmp/lookup-vs-wait}
mkdir -p $OUT && cd $OUT
python -m drafter_service --address 127.0.0.1:51060 > drafter.log 2>&1 &
python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:51062 \
  --no-enable-prefix-caching > verifier.log 2>&1 &
gw() {  # port, lookups
  python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 + 100)) \
    --drafter-address 127.0.0.1:51060 --verifier-addresses 127.0.0.1:51062 \
    --speculative-config '{"method": "suffix"}' --speculation-debug "{\"lookup\": \"$2\"}" > gateway-$1.log 2>&1 &
}
gw 8201 auto
gw 8203 off
for port in 8201 8203; do until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 2; done; done
for round in $(seq 1 ${ROUNDS:-2}); do
  for port in 8201 8203; do
    methods=$([ $port = 8201 ] && echo none,suffix || echo suffix)
    speclane bench serve --url http://127.0.0.1:$port --dataset ${DATASETS:-sharegpt,humaneval,agent-loop,code-edit} \
      --concurrency ${CONCURRENCY:-1} --num-prompts ${NUM_PROMPTS:-8} --max-turns 1 --methods $methods \
      --max-tokens 128 --output-dir $OUT/out-$round-$port > bench-$round-$port.log 2>&1
    curl -s http://127.0.0.1:$port/metrics | grep 'next_round_offers_total{' > metrics-$round-$port.txt
    echo "round $round port $port done"
  done
done
kill $(jobs -p)
