#!/usr/bin/env bash
# No speed lost to the step planner: `speclane bench serve` (suffix, the shipped default) on the four data sets
# at concurrency 1 and 16, the code before the planner (BEFORE, a checkout with its own .venv) and after it
# (this checkout), alternated rounds, one server at a time.
#   BEFORE=/work/wt-before flock /tmp/speclane-bench.lock docs/benchmarks/planner/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
AFTER=$PWD
OUT=${OUT:-$AFTER/docs/benchmarks/planner}
PORT=8400
for round in 1 2; do
  for side in before after; do
    tree=$([ "$side" = before ] && echo "$BEFORE" || echo "$AFTER")
    # Each server starts cold: no drafter snapshot (the code before the planner kept none under serve).
    cold=$([ "$side" = after ] && echo "--snapshot-path=" || echo "")
    (cd "$tree" && exec .venv/bin/speclane serve --port $PORT --grpc-port $((PORT + 1)) --log-level warning \
       $cold > /tmp/planner-serve.log 2>&1) &
    serve=$!
    for _ in $(seq 180); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    for concurrency in 1 16; do
      prompts=$([ $concurrency = 1 ] && echo 3 || echo 16)
      "$AFTER/.venv/bin/speclane" bench serve --url http://127.0.0.1:$PORT \
        --dataset humaneval,sharegpt,agent-loop,code-edit --concurrency $concurrency --num-prompts $prompts \
        --max-turns 1 --max-tokens 128 --methods suffix --output-dir "$OUT/raw/$side-$round-c$concurrency" > /dev/null
    done
    kill $serve; wait $serve || true
  done
done
"$AFTER/.venv/bin/python" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
pooled = {}
for path in sorted((out / "raw").glob("*/results.json")):
    side = path.parent.name.split("-")[0]
    for run in json.loads(path.read_text())["runs"]:
        key = (run["dataset"], run["concurrency"], side)
        tokens, seconds = pooled.get(key, (0.0, 0.0))
        pooled[key] = (tokens + run["mean_output_tokens"] * (run["requests"] - run["failed"]),
                       seconds + run["duration_s"])
print("| data set | concurrency | before (tok/s) | after (tok/s) | after / before |")
print("|---|---|---|---|---|")
for dataset, concurrency in sorted({(d, c) for d, c, _ in pooled}):
    before, after = (pooled[(dataset, concurrency, s)][0] / pooled[(dataset, concurrency, s)][1]
                     for s in ("before", "after"))
    print(f"| {dataset} | {concurrency} | {before:.1f} | {after:.1f} | {after / before:.3f}x |")
PY
