"""Greedy outputs with and without speculation through a running server: how many differ, and where."""
import sys

from openai import OpenAI

from speclane_cli.bench.workloads import load_workload

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")
method, n = sys.argv[1], int(sys.argv[2])
convs = load_workload("sharegpt", n, 0, 1)
differ = []
for i, c in enumerate(convs):
    outs = []
    for m in ("none", method):
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=c.messages([]), max_tokens=128,
                                           temperature=0, logprobs=True, extra_body={"speculation": {"method": m}})
        outs.append([t.token for t in r.choices[0].logprobs.content])
    a, b = outs
    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    if first is not None:
        differ.append((i, first))
print(f"{method}: {len(differ)} of {len(convs)} outputs differ from none; (prompt, first differing token): {differ}")
