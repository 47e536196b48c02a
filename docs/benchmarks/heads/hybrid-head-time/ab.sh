#!/bin/bash
# A/B: hybrid's head worth with the head's drafting (new, /work/main) and without (old, a clone at 2149ebc in /tmp/ci),
# one verifier and one drafter, two gateways, rounds alternated.
source /work/main/.venv/bin/activate
M=~/.cache/speclane/models/smollm2-135m-instruct
CFG='{"method": "eagle3", "num_speculative_tokens": 4}'
OUT=${OUT:-/tmp/s9/ab}
ROUNDS=${ROUNDS:-4}
mkdir -p $OUT && cd $OUT
PYTHONPATH=/work/main python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:51062 --speculative-config "$CFG" > verifier.log 2>&1 &
PYTHONPATH=/work/main python -m drafter_service --address 127.0.0.1:51060 > drafter.log 2>&1 &
gw() {  # port, source
  (cd $2 && PYTHONPATH=$2 python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 + 100)) \
    --drafter-address 127.0.0.1:51060 --verifier-addresses 127.0.0.1:51062 --speculative-config "$CFG" --log-level debug > $OUT/gateway-$1.log 2>&1 &)
}
gw 8201 /work/main
gw 8202 /tmp/ci
for port in 8201 8202; do
  until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 2; done
done
echo ready
for round in $(seq 1 $ROUNDS); do
  ports="8201 8202"; [ $((round % 2)) = 0 ] && ports="8202 8201"
  for port in $ports; do
    speclane bench serve --url http://127.0.0.1:$port --dataset sharegpt,humaneval --concurrency 1 --num-prompts 4 \
      --max-turns 2 --methods hybrid --num-speculative-tokens 4 --max-tokens 128 --output-dir $OUT/out-$round-$port > bench-$round-$port.log 2>&1
    echo "round $round port $port done"
  done
done
pkill -f "gateway --model"; pkill -f drafter_service; pkill -f verifier_service
echo finished
