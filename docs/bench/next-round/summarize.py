"""Summarizes a side-by-side.sh run: per gateway, the steps' mean wait beyond the forward pass (from the
gateways' `verify_step` debug logs), the next-round hit rate and TPOT per round (from the bench results).

usage: python docs/bench/next-round/summarize.py OUT [JSON]"""

import json
import pathlib
import statistics
import sys

GATEWAYS = {8201: "new, local", 8202: "new, link", 8203: "base, local", 8204: "base, link"}


def gateway_summary(out: pathlib.Path, port: int) -> dict:
    steps = [json.loads(line) for line in (out / f"gateway-{port}.log").read_text().splitlines()
             if '"verify_step"' in line]
    runs = [json.loads((d / "results.json").read_text())["runs"][0] for d in sorted(out.glob(f"out-*-{port}"))]
    return {
        "steps": len(steps),
        "wait_beyond_forward_ms": statistics.mean(s["verifier_wait_ms"] - s["forward_ms"] for s in steps),
        "forward_ms": statistics.mean(s["forward_ms"] for s in steps),
        "hit_rate": sum(r["next_round_steps"] for r in runs) / sum(r["verify_steps"] for r in runs),
        "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in runs),
        "tpot_ms": [r["mean_tpot_ms"] for r in runs],
    }


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    rows = {name: gateway_summary(out, port) for port, name in GATEWAYS.items()}
    for name, row in rows.items():
        print(f"{name:12s} steps {row['steps']}, beyond the forward pass {row['wait_beyond_forward_ms']:.2f} ms, "
              f"forward {row['forward_ms']:.1f} ms, hit rate {row['hit_rate']:.3f}, "
              f"tokens/step {row['tokens_per_step']:.2f}, TPOT {' '.join(f'{t:.1f}' for t in row['tpot_ms'])}")
    for side in ("new", "base"):
        local, link = rows[f"{side}, local"], rows[f"{side}, link"]
        forward = (local["forward_ms"] + link["forward_ms"]) / 2
        print(f"{side}: the link adds {link['wait_beyond_forward_ms'] - local['wait_beyond_forward_ms']:.2f} ms a "
              f"step; link / local by step accounting "
              f"{(forward + local['wait_beyond_forward_ms']) / (forward + link['wait_beyond_forward_ms']):.3f}, "
              f"by pooled TPOT {statistics.mean(local['tpot_ms']) / statistics.mean(link['tpot_ms']):.3f}")
    if len(sys.argv) > 2:
        pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
