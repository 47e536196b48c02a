#!/bin/bash
# One --speculation-debug setting compared across a delayed link: 4 gateways over one drafter and one verifier,
# ON on 8201 (local) and 8202 (5 ms link), OFF on 8203 (local) and 8204 (link); METHOD is benched.
# Run from an activated venv; writes logs and results under $OUT. (The results in README.md ran the keys
# these settings replaced: next_round_drafts and next_round_lookup.)
M=~/.cache/speclane/models/smollm2-135m-instruct
OUT=${OUT:-/tmp/next-round}
ON=${ON:-'{}'}; OFF=${OFF:-'{"next_round": false}'}; export METHOD=${METHOD:-suffix}
DRAFTER_FLAGS=${DRAFTER_FLAGS---max-cached-requests 0}
ROUNDS=${ROUNDS:-2}; LOG_LEVEL=${LOG_LEVEL:-info}
source "$(dirname "$(realpath "$0")")/rounds.sh"
mkdir -p $OUT && cd $OUT
python -m drafter_service --address 127.0.0.1:51060 $DRAFTER_FLAGS > drafter.log 2>&1 &
python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:51062 > verifier.log 2>&1 &
speclane bench link --listen 127.0.0.1:51064 --target 127.0.0.1:51062 --one-way-delay-ms 2.5 > link.log 2>&1 &
gw() {  # port, verifier address, the setting
  python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 + 100)) \
    --drafter-address 127.0.0.1:51060 --verifier-addresses $2 --log-level $LOG_LEVEL \
    --speculative-config '{"method": "suffix"}' --speculation-debug "$3" > gateway-$1.log 2>&1 &
}
gw 8201 127.0.0.1:51062 "$ON"    # local
gw 8202 127.0.0.1:51064 "$ON"    # 5 ms link
gw 8203 127.0.0.1:51062 "$OFF"   # local
gw 8204 127.0.0.1:51064 "$OFF"   # 5 ms link
bench_rounds $ROUNDS 8201 8202 8203 8204
curl -s http://127.0.0.1:8202/metrics | grep next_round_offers_total > metrics-8202.txt
curl -s http://127.0.0.1:8201/metrics | grep next_round_offers_total > metrics-8201.txt
kill $(jobs -p)
