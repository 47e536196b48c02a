#!/bin/bash
# Side by side over one verifier and one 5 ms link: this checkout ($NEW) against another commit ($BASE),
# each with its own drafter and two gateways (local, over the link), next-round drafts on. Run from the repository root.
NEW=${NEW:-$PWD}; BASE=${BASE:?a worktree of the commit to compare, with its built drafter core}
source $NEW/.venv/bin/activate
M=~/.cache/speclane/models/smollm2-135m-instruct
OUT=${OUT:-/tmp/next-round-lookahead}
ROUNDS=${ROUNDS:-3}
source "$(dirname "$(realpath "$0")")/rounds.sh"
mkdir -p $OUT && cd $OUT
PYTHONPATH=$NEW python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:51062 > verifier.log 2>&1 &
PYTHONPATH=$NEW speclane bench link --listen 127.0.0.1:51064 --target 127.0.0.1:51062 --one-way-delay-ms 2.5 > link.log 2>&1 &
PYTHONPATH=$NEW python -m drafter_service --address 127.0.0.1:51060 --max-cached-requests 0 > drafter-new.log 2>&1 &
(cd $BASE && PYTHONPATH=$BASE python -m drafter_service --address 127.0.0.1:51070 --max-cached-requests 0 > $OUT/drafter-base.log 2>&1 &)
gw() {  # port, source, drafter, verifier
  (cd $2 && PYTHONPATH=$2 python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 + 100)) \
    --drafter-address $3 --verifier-addresses $4 --log-level debug > $OUT/gateway-$1.log 2>&1 &)
}
gw 8201 $NEW 127.0.0.1:51060 127.0.0.1:51062   # new, local
gw 8202 $NEW 127.0.0.1:51060 127.0.0.1:51064   # new, link
gw 8203 $BASE 127.0.0.1:51070 127.0.0.1:51062    # base, local
gw 8204 $BASE 127.0.0.1:51070 127.0.0.1:51064    # base, link
bench_rounds $ROUNDS 8201 8202 8203 8204
pkill -f "gateway --model"; pkill -f drafter_service; pkill -f verifier_service; pkill -f "bench link"
echo finished
