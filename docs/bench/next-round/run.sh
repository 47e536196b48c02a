#!/bin/bash
# Next-round drafts across a delayed link: 4 gateways over one drafter and one verifier.
# Run from an activated venv; writes logs and results under $OUT.
M=~/.cache/speclane/models/smollm2-135m-instruct
OUT=${OUT:-/tmp/next-round}
source "$(dirname "$(realpath "$0")")/rounds.sh"
mkdir -p $OUT && cd $OUT
python -m drafter_service --address 127.0.0.1:51060 --max-cached-requests 0 > drafter.log 2>&1 &
python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:51062 > verifier.log 2>&1 &
speclane bench link --listen 127.0.0.1:51064 --target 127.0.0.1:51062 --one-way-delay-ms 2.5 > link.log 2>&1 &
gw() {  # port, verifier address, next_round_drafts
  python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 + 100)) \
    --drafter-address 127.0.0.1:51060 --verifier-addresses $2 \
    --speculative-config "{\"method\": \"suffix\", \"next_round_drafts\": $3}" > gateway-$1.log 2>&1 &
}
gw 8201 127.0.0.1:51062 true    # local, next round
gw 8202 127.0.0.1:51064 true    # 5 ms link, next round
gw 8203 127.0.0.1:51062 false   # local, no next round
gw 8204 127.0.0.1:51064 false   # 5 ms link, no next round
bench_rounds 2 8201 8202 8203 8204
kill $(jobs -p)
