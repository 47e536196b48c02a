#!/bin/bash
# n-gram against suffix on code edits at 16 sequences, each method run alone (alternated: n-gram, suffix, suffix,
# n-gram, three times), with the CPU time each of the stack's processes spent on the run, read from /proc.
#   flock /tmp/speclane-bench.lock docs/benchmarks/suffix-vs-ngram/process_cpu.sh
set -u
cd "$(dirname "$0")/../../.."
out=$(mktemp -d)
speclane=.venv/bin/speclane
$speclane serve --port 8500 --snapshot-path= --no-enable-prefix-caching > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server; wait $server' EXIT
until curl -sf http://127.0.0.1:8500/v1/models > /dev/null; do sleep 2; done
ticks() {  # user + system clock ticks of the processes whose command line matches $1
  for pid in $(pgrep -f "$1"); do awk '{print $14 + $15}' "/proc/$pid/stat"; done | paste -sd+ | bc
}
for round in 1 2 3; do
  for method in ngram suffix suffix ngram; do
    before=($(ticks drafter_service) $(ticks verifier_service) $(ticks gateway))
    $speclane bench serve --url http://127.0.0.1:8500 --dataset code-edit --concurrency 16 --num-prompts 16 \
      --max-turns 1 --max-tokens 128 --methods "$method" --output-dir "$out/$method-$round" > /dev/null 2>&1
    after=($(ticks drafter_service) $(ticks verifier_service) $(ticks gateway))
    tps=$(python3 -c "import json; print(round(json.load(open('$out/$method-$round/results.json'))['runs'][0]['throughput_tps'], 1))")
    echo "$method round $round: $tps tok/s; CPU ticks: drafter $((after[0] - before[0])), verifier $((after[1] - before[1])), gateway $((after[2] - before[2]))"
  done
done
