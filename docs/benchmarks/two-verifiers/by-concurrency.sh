#!/bin/bash
# One gateway over two verifiers (port 8101) and one over the first alone (8102), one thread each,
# benched alternately at each concurrency; the verifiers log every forward pass so that
# summarize.py can tell how full and how long their passes were. Run from an activated venv.
M=~/.cache/speclane/models/smollm2-135m-instruct
OUT=${OUT:-/tmp/two-verifiers}
mkdir -p $OUT && cd $OUT && rm -f marks
python -m drafter_service --address 127.0.0.1:51060 > drafter.log 2>&1 &
for port in 51062 51063; do
  python -m verifier_service --model $M --model-name smollm2-135m-instruct --address 127.0.0.1:$port --threads 1 \
    --log-level debug > verifier-$port.log 2>&1 &
done
sleep 40
gw() {  # HTTP port, verifier addresses
  python -m gateway --model $M --served-model-name smollm2-135m-instruct --port $1 --grpc-address 127.0.0.1:$(($1 - 30)) \
    --drafter-address 127.0.0.1:51060 --verifier-addresses $2 > gateway-$1.log 2>&1 &
}
gw 8101 127.0.0.1:51062,127.0.0.1:51063
gw 8102 127.0.0.1:51062
sleep 15
for c in ${CONCURRENCY:-8 32 64}; do
  for port in 8102 8101; do
    echo "$port $c start $(date +%s.%N)" >> marks
    speclane bench serve --url http://127.0.0.1:$port --dataset sharegpt --concurrency $c --num-prompts $((2 * c)) \
      --max-turns 1 --methods suffix --max-tokens 64 --output-dir $OUT/bench-$port-$c
    echo "$port $c end $(date +%s.%N)" >> marks
  done
done
kill $(jobs -p)
