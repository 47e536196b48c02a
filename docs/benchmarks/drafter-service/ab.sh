#!/usr/bin/env bash
# One drafter process under 8, 16 and 32 simulated verifiers, two source trees alternated over two rounds
# (before, after, after, before), each tree's own drafter and load. A tree needs its drafter core built
# (drafter_service/_core*.so). Run it under the machine-wide benchmark lock:
#   git worktree add /tmp/before <commit> && cp drafter_service/_core*.so /tmp/before/drafter_service/
#   flock /tmp/speclane-bench.lock docs/benchmarks/drafter-service/ab.sh /tmp/before . OUTPUT_DIR
set -euo pipefail
before=$(realpath "$1") after=$(realpath "$2") out=$(realpath -m "$3")
python="$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python"
run() {  # tree, name
  (cd "$1" && PYTHONPATH="$1" "$python" -c "import sys; from speclane_cli.main import main; sys.exit(main())" \
    bench drafter --service --verifiers 8,16,32 --seconds 10 --client-processes 4 --output-dir "$out/$2")
}
run "$before" before-1; run "$after" after-1; run "$after" after-2; run "$before" before-2
