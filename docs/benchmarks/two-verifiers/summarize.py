"""Reads by-concurrency.sh's output folder: each bench run's throughput, and the
forward passes each verifier ran during it (from its debug log's forward_pass lines)."""

import datetime
import json
import pathlib
import sys


def timestamp(line: dict) -> float:
    return datetime.datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def main(folder: pathlib.Path) -> None:
    marks = {}
    for port, concurrency, edge, seconds in (line.split() for line in (folder / "marks").read_text().splitlines()):
        marks[port, concurrency, edge] = float(seconds)
    passes = {log.stem: [json.loads(line) for line in log.read_text().splitlines() if '"forward_pass"' in line]
              for log in sorted(folder.glob("verifier-*.log"))}
    summary = []
    starts = [key for key in marks if key[2] == "start"]
    for port, concurrency, _ in sorted(starts, key=lambda key: (int(key[1]), key[0] != "8102")):
        start, end = marks[port, concurrency, "start"], marks[port, concurrency, "end"]
        results = json.loads((folder / f"bench-{port}-{concurrency}" / "results.json").read_text())
        run = results["runs"][0]
        entry = {"verifiers": 2 if port == "8101" else 1, "concurrency": int(concurrency),
                 "command": results["command"].split(" --output-dir")[0],
                 "throughput_tps": round(run["throughput_tps"], 1), "mean_tpot_ms": round(run["mean_tpot_ms"], 1),
                 "tokens_per_step": round(run["tokens_per_step"], 3), "requests": run["requests"],
                 "failed": run["failed"], "passes": []}
        for name, lines in passes.items():
            during = [line for line in lines if start <= timestamp(line) <= end]
            if not during:
                continue
            forward = sum(line["forward_seconds"] for line in during)
            entry["passes"].append({
                "verifier": name, "passes": len(during), "busy": round(forward / (end - start), 3),
                "mean_sequences": round(sum(line["sequences"] for line in during) / len(during), 2),
                "mean_tokens": round(sum(line["tokens"] for line in during) / len(during), 1),
                "mean_forward_ms": round(1000 * forward / len(during), 1)})
        summary.append(entry)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
