"""Summarizes a side-by-side.sh or run.sh run: per gateway, the steps' mean wait beyond the forward pass (from the
gateways' `verify_step` debug logs, which run.sh writes with LOG_LEVEL=debug), the next-round hit rate and TPOT
per round (from the bench results).

usage: python docs/benchmarks/next-round/summarize.py OUT [JSON] [SIDES]   (SIDES: the names of gateways 8201/8202
and 8203/8204, "new,base" for side-by-side.sh, e.g. "on,off" for run.sh)"""

import json
import pathlib
import statistics
import sys


def gateway_summary(out: pathlib.Path, port: int) -> dict:
    steps = [json.loads(line) for line in (out / f"gateway-{port}.log").read_text().splitlines()
             if '"verify_step"' in line]
    runs = [json.loads((d / "results.json").read_text())["runs"][0] for d in sorted(out.glob(f"out-*-{port}"))]
    return {
        "steps": len(steps),
        "wait_beyond_forward_ms": statistics.mean(s["verifier_wait_ms"] - s["forward_ms"] for s in steps),
        "forward_ms": statistics.mean(s["forward_ms"] for s in steps),
        "looked_up_steps": sum(s["source"] == "lookup" for s in steps),
        "hit_rate": sum(r["next_round_steps"] for r in runs) / sum(r["verify_steps"] for r in runs),
        "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in runs),
        "tpot_ms": [r["mean_tpot_ms"] for r in runs],
    }


def speed(row: dict) -> float:
    """Tokens per ms of a step: where the two gateways' drafts differ, their steps do too."""
    return row["tokens_per_step"] / (row["forward_ms"] + row["wait_beyond_forward_ms"])


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    sides = (sys.argv[3] if len(sys.argv) > 3 else "new,base").split(",")
    gateways = {8201: f"{sides[0]}, local", 8202: f"{sides[0]}, link", 8203: f"{sides[1]}, local",
                8204: f"{sides[1]}, link"}
    rows = {name: gateway_summary(out, port) for port, name in gateways.items()}
    for name, row in rows.items():
        print(f"{name:12s} steps {row['steps']} ({row['looked_up_steps']} looked up), beyond the forward pass "
              f"{row['wait_beyond_forward_ms']:.2f} ms, forward {row['forward_ms']:.1f} ms, hit rate "
              f"{row['hit_rate']:.3f}, tokens/step {row['tokens_per_step']:.2f}, "
              f"TPOT {' '.join(f'{t:.1f}' for t in row['tpot_ms'])}")
    for side in sides:
        local, link = rows[f"{side}, local"], rows[f"{side}, link"]
        forward = (local["forward_ms"] + link["forward_ms"]) / 2
        print(f"{side}: the link adds {link['wait_beyond_forward_ms'] - local['wait_beyond_forward_ms']:.2f} ms a "
              f"step; link / local by step accounting "
              f"{(forward + local['wait_beyond_forward_ms']) / (forward + link['wait_beyond_forward_ms']):.3f}, "
              f"with each one's forward pass and tokens per step {speed(link) / speed(local):.3f}, "
              f"by pooled TPOT {statistics.mean(local['tpot_ms']) / statistics.mean(link['tpot_ms']):.3f}")
    if len(sys.argv) > 2:
        pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
