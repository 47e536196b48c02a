#!/bin/bash
# A/B: the head's own time priced in its drafts (new verifier, /work/main) or not (old, a clone at c6cca8d in /tmp/ci);
# one drafter, one gateway per verifier, rounds alternated.
source /work/main/.venv/bin/activate
M=~/.cache/speclane/models/smollm2-135m-instruct
CFG='{"method": "eagle3", "num_speculative_tokens": 4}'
OUT=${OUT:-/tmp/s9/ab2}
ROUNDS=${ROUNDS:-3}
mkdir -p $OUT && cd $OUT
PYTHONPATH=/work/main python -m drafter_service --address 127.0.0.1:51060 > drafter.log 2>&1 &
verifier() {  # port, source
  (cd $2 && PYTHONPATH=$2 python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:$1 \
    --speculative-config "$CFG" > $OUT/verifier-$1.log 2>&1 &)
  until grep -q draft_token_cost $OUT/verifier-$1.log 2>/dev/null; do sleep 2; done
}
verifier 51062 /work/main
verifier 51072 /tmp/ci
gw() {  # port, verifier port
  (cd /work/main && PYTHONPATH=/work/main python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 + 100)) \
    --drafter-address 127.0.0.1:51060 --verifier-addresses 127.0.0.1:$2 --speculative-config "$CFG" --log-level debug > $OUT/gateway-$1.log 2>&1 &)
}
gw 8201 51062
gw 8202 51072
for port in 8201 8202; do
  until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 2; done
done
echo ready
for round in $(seq 1 $ROUNDS); do
  ports="8201 8202"; [ $((round % 2)) = 0 ] && ports="8202 8201"
  for port in $ports; do
    speclane bench serve --url http://127.0.0.1:$port --dataset sharegpt --concurrency 1,4 --num-prompts 8 \
      --max-turns 1 --methods eagle3,hybrid --num-speculative-tokens 4 --max-tokens 128 --output-dir $OUT/out-$round-$port > bench-$round-$port.log 2>&1
    echo "round $round port $port done"
  done
done
pkill -f "gateway --model"; pkill -f drafter_service; pkill -f verifier_service
echo finished
