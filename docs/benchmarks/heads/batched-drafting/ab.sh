#!/bin/bash
# A/B: heads drafting a step's sequences together (this checkout) against one after another (OLD: a clone of
# this repository at 990ffe9). One drafter; one verifier per side, each with the shipped EAGLE-3 head at k=4;
# one gateway per verifier; the bench alternates the two sides round by round.
# Usage: OLD=/tmp/old [OUT=dir] bash docs/benchmarks/heads/batched-drafting/ab.sh   (repository root, venv active)
# Run 1 (after-step/) was at 13697ea, run 2 (on-demand/) at d902a8c.
set -e
NEW=$(pwd)
OLD=${OLD:?a clone of this repository at 990ffe9}
OUT=${OUT:-$NEW/docs/benchmarks/heads/batched-drafting/rerun}
ROUNDS=${ROUNDS:-2}
MODEL=$(python -c "from speclane.models import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL))")
CFG='{"method": "eagle3", "num_speculative_tokens": 4}'
mkdir -p "$OUT"
trap 'kill $(jobs -p) 2>/dev/null' EXIT
PYTHONPATH=$NEW python -m drafter_service --address 127.0.0.1:51060 > "$OUT/drafter.log" 2>&1 &
verifier() {  # port, source tree
  (cd "$2" && PYTHONPATH=$2 exec python -m verifier_service --model "$MODEL" --model-name smollm2-135m-instruct \
    --address 127.0.0.1:$1 --speculative-config "$CFG") > "$OUT/verifier-$1.log" 2>&1 &
  until grep -q draft_token_cost "$OUT/verifier-$1.log" 2>/dev/null; do sleep 2; done
}
verifier 51062 "$NEW"
verifier 51072 "$OLD"
gateway() {  # HTTP port, verifier port
  PYTHONPATH=$NEW python -m gateway --model "$MODEL" --served-model-name smollm2-135m-instruct --port $1 \
    --grpc-address 127.0.0.1:$(($1 + 100)) --drafter-address 127.0.0.1:51060 --verifier-addresses 127.0.0.1:$2 \
    --speculative-config "$CFG" > "$OUT/gateway-$1.log" 2>&1 &
}
gateway 8201 51062  # new
gateway 8202 51072  # old
for port in 8201 8202; do
  until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 2; done
done
for round in $(seq 1 "$ROUNDS"); do
  ports="8201 8202"; [ $((round % 2)) = 0 ] && ports="8202 8201"
  for port in $ports; do
    speclane bench serve --url http://127.0.0.1:$port --dataset sharegpt,code-edit --concurrency 4,8 --num-prompts 8 \
      --max-turns 1 --methods none,eagle3,hybrid --num-speculative-tokens 4 --max-tokens 128 \
      --output-dir "$OUT/round-$round-$port" > "$OUT/bench-$round-$port.log" 2>&1
    echo "round $round, port $port done"
  done
done
