"""`speclane bench drafter`: the suffix / n-gram drafter core against Arctic
Inference's SuffixDecodingCache (when `arctic_inference` is importable), side
by side in one run on the same token streams:

- corpus: HumanEval prompts + solutions and ShareGPT first turns, tokenized;
- agent: an agent loop re-emitting files with small edits (prompt = the file,
  response = the file with a few tokens changed), as in SuffixDecoding's agentic workloads.

Each response is replayed greedily: the drafter drafts, the draft is accepted
up to the first token that differs from the real response, accepted + 1 tokens
are committed. Both implementations are driven through the same Arctic API.

With --service it measures the drafter service instead (speclane_cli/bench/drafter_load.py).
"""

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

from drafter_service import SuffixDecodingCache, _core
from speclane_cli.bench import drafter_load

PATH_ARGS = dict(max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1)


def add_arguments(parser) -> None:
    parser.add_argument("--sharegpt", type=int, default=150, help="ShareGPT conversations in the corpus")
    parser.add_argument("--max-response", type=int, default=512, help="tokens kept of each response")
    parser.add_argument("--agent-files", type=int, default=20, help="files the agent loop keeps re-emitting")
    parser.add_argument("--agent-rounds", type=int, default=6, help="edit rounds per file")
    parser.add_argument("--k", type=int, default=32, help="max draft tokens (num_speculative_tokens)")
    parser.add_argument("--arctic-path", default="", help="directory to import arctic_inference from")
    parser.add_argument("--seed", type=int, default=0)
    drafter_load.add_arguments(parser)


def _arctic_cache():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache as ArcticCache
    except ImportError:
        return None
    return ArcticCache


def _streams(args) -> tuple[list, list]:
    from transformers import AutoTokenizer

    from speclane.models import resolve_model
    from speclane_cli.datasets import humaneval_problems, sharegpt_conversations

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)[:args.max_response]  # noqa: E731
    problems = humaneval_problems()
    corpus = [(encode(p["prompt"]), encode(p["canonical_solution"])) for p in problems]
    for conversation in sharegpt_conversations():
        if len(corpus) >= len(problems) + args.sharegpt:
            break
        if len(conversation) >= 2 and conversation[0]["role"] == "user":
            corpus.append((encode(conversation[0]["content"]), encode(conversation[1]["content"])))
    corpus = [(prompt, response) for prompt, response in corpus if response]
    rng = random.Random(args.seed)
    agent = []
    for problem in problems[:args.agent_files]:
        version = tokenizer.encode(problem["prompt"] + problem["canonical_solution"], add_special_tokens=False)
        for _ in range(args.agent_rounds):
            edited = list(version)
            for _ in range(3):  # a few small edits per re-emission
                at = rng.randrange(len(edited))
                inserted = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 3))]
                edited[at:at + rng.randint(0, 2)] = inserted
            agent.append((version, edited))
            version = edited
    return corpus, agent


def _replay_request(cache, number: int, prompt: list, response: list, k: int, result: dict) -> None:
    """One request replayed greedily: draft, accept up to the first wrong token, commit accepted + 1."""
    clock = time.perf_counter
    cache.start_request(number, prompt)
    full, position = prompt + response, 0
    while position < len(response):
        end = len(prompt) + position
        context = full[max(0, end - 64):end]
        began = clock()
        draft = cache.speculate(number, context, k, **PATH_ARGS)
        took = clock() - began
        result["hits" if draft.token_ids else "misses"].append(took)
        good = 0
        for token, actual in zip(draft.token_ids, response[position:]):
            if token != actual:
                break
            good += 1
        committed = response[position:position + good + 1]
        began = clock()
        cache.add_active_response(number, committed)
        result["appends"].append((clock() - began) / len(committed))
        position += len(committed)
        result["steps"] += 1
        result["drafted"] += len(draft.token_ids)
        result["accepted"] += good
    cache.stop_request(number)


def _turns(players: int, total: int, block: int):
    """(player, first, stop): `players` take turns over items first..stop-1,
    `block` items at a time, alternating which goes first."""
    for first in range(0, total, block):
        order = range(players) if (first // block) % 2 == 0 else reversed(range(players))
        for which in order:
            yield which, first, min(first + block, total)


def replay(caches: list, requests, k: int, block: int = 16) -> list[dict]:
    """Greedy replay through the Arctic API of each cache. The caches take turns
    every `block` requests (alternating which goes first), so the machine's
    drifts hit all alike while each keeps its own working set warm, as it would
    serving alone. Returns each cache's timings and acceptance."""
    results = [dict(hits=[], misses=[], appends=[], steps=0, drafted=0, accepted=0) for _ in caches]
    for which, first, stop in _turns(len(caches), len(requests), block):
        for number in range(first, stop):
            prompt, response = requests[number]
            _replay_request(caches[which], number, prompt, response, k, results[which])
    tokens = sum(len(response) for _, response in requests)
    return [dict(hits=r["hits"], misses=r["misses"], append=statistics.mean(r["appends"]),
                 tokens_per_step=tokens / r["steps"], acceptance=r["accepted"] / max(r["drafted"], 1))
            for r in results]


def _batch_stepper(make, chosen: list, k: int, depth: int):
    """A function running one decode step of `chosen`'s requests: one token
    committed and a draft for each. Ours (make None) uses the batch call."""
    if make is None:
        core = _core.Cache(depth, 100000)
        for number, (prompt, _) in enumerate(chosen):
            core.start_request(number, prompt, max_spec_tokens=k, **PATH_ARGS)
        ids = list(range(len(chosen)))
        return lambda step: core.step(ids, [[response[step % len(response)]] for _, response in chosen])
    cache = make(depth, 100000)
    contexts = []
    for number, (prompt, _) in enumerate(chosen):
        cache.start_request(number, prompt)
        contexts.append(list(prompt))

    def step_all(step: int) -> None:
        for number, (_, response) in enumerate(chosen):
            token = response[step % len(response)]
            contexts[number].append(token)
            cache.add_active_response(number, [token])
            cache.speculate(number, contexts[number][-64:], k, **PATH_ARGS)
    return step_all


def batch_cpu(makes: list, requests, batch: int, k: int, depth: int, steps: int = 60, block: int = 10) -> list[float]:
    """CPU seconds per decode step with `batch` running requests, for each
    implementation; they take turns every `block` steps, as in `replay`, and
    the first block (first touches of fresh memory) is not counted."""
    chosen = [requests[i % len(requests)] for i in range(batch)]
    steppers = [_batch_stepper(make, chosen, k, depth) for make in makes]
    spent = [0.0] * len(makes)
    for which, first, stop in _turns(len(makes), steps + block, block):
        began = time.process_time()
        for step in range(first, stop):
            steppers[which](step)
        if first > 0:
            spent[which] += time.process_time() - began
    return [total / steps for total in spent]


_MEMORY_PROBE = """
import json, os, sys
impl, depth, path, arctic_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, arctic_path)
if impl == "arctic":
    from arctic_inference.suffix_decoding import SuffixDecodingCache
else:
    from drafter_service import SuffixDecodingCache
responses = json.load(open(path))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
cache = SuffixDecodingCache(depth, 100000)
for number, response in enumerate(responses):
    cache.start_request(number, [])
    cache.add_active_response(number, response)
    cache.stop_request(number)
print(rss() - before)
"""


def bytes_per_token(impl: str, requests, depth: int, arctic_path: str) -> float:
    """Resident memory growth per cached response token, in a fresh process (no reused heap)."""
    responses = [response for _, response in requests]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(responses, file)
        file.flush()
        out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, impl, str(depth), file.name, arctic_path],
                             capture_output=True, text=True, check=True).stdout
    return int(out) / sum(len(response) for response in responses)


def ngram_costs(tokens: list[int], steps: int = 200) -> tuple[float, float]:
    """Seconds per step of the incremental index (append a token + look up) and of a full rescan."""
    index = _core.NgramIndex(2, 5)
    index.append(tokens[:-steps])
    began = time.perf_counter()
    for token in tokens[-steps:]:
        index.append([token])
        index.propose(8)
    incremental = (time.perf_counter() - began) / steps
    began = time.perf_counter()
    for _ in range(50):
        index.propose_rescan(8)
    return incremental, (time.perf_counter() - began) / 50


def _quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered) * 1e6:7.2f} / {ordered[int(0.99 * (len(ordered) - 1))] * 1e6:7.2f}"


def run(args) -> int:
    if args.service:
        return drafter_load.run(args)
    if args.arctic_path:
        sys.path.insert(0, args.arctic_path)
    arctic = _arctic_cache()
    corpus, agent = _streams(args)
    print(f"corpus: {len(corpus)} requests, {sum(len(r) for _, r in corpus)} response tokens; "
          f"agent loop: {len(agent)} re-emissions, {sum(len(r) for _, r in agent)} tokens; k={args.k}")
    print("arctic_inference:", "present" if arctic else "not importable (ours only)")
    impls = [("speclane", SuffixDecodingCache)] + ([("arctic", arctic)] if arctic else [])
    rows = []
    for depth in (24, 64):
        results = replay([make(depth, 100000) for _, make in impls], corpus + agent, args.k)
        rows += [(f"{name} d{depth}", result) for (name, _), result in zip(impls, results)]
    print("\nreplay of corpus + agent loop (same stream, same depth, taking turns every 16 requests,"
          " Arctic API from Python)")
    print(f"{'':16} {'us/append':>10} {'speculate hit med/p99 us':>26} {'miss med/p99 us':>20}")
    for label, result in rows:
        print(f"{label:16} {result['append'] * 1e6:10.2f} {_quantiles(result['hits']):>26} "
              f"{_quantiles(result['misses']):>20}")
    if arctic:
        for ours, theirs in zip(rows[0::2], rows[1::2]):
            median = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
            print(f"ratio {ours[0][-3:]:10} {ours[1]['append'] / theirs[1]['append']:10.2f} "
                  f"{median(ours[1]['hits']) / median(theirs[1]['hits']):17.2f} (median) "
                  f"{median(ours[1]['misses']) / median(theirs[1]['misses']):11.2f} (median)")

    print("\nCPU per decode step (one token committed + a draft per request), depth 24")
    for batch in (64, 256):
        ours, *theirs = batch_cpu([None] + ([arctic] if arctic else []), corpus, batch, args.k, 24)
        line = f"batch {batch:3}: speclane {ours * 1e3:7.3f} ms"
        if theirs:
            line += f"   arctic {theirs[0] * 1e3:7.3f} ms   ratio {ours / theirs[0]:5.2f}"
        print(line)

    print("\nbytes per cached response token (RSS growth of a fresh process), depth 24 and 64")
    for name, _ in impls:
        print(f"{name:10} " + "  ".join(f"d{depth}: {bytes_per_token(name, corpus, depth, args.arctic_path):7.1f}"
                                        for depth in (24, 64)))

    print("\ngreedy replay: tokens per step / acceptance")
    settings = [("speclane", SuffixDecodingCache, 24), ("speclane", SuffixDecodingCache, 32)]
    settings += [("arctic", arctic, 24), ("arctic", arctic, 64)] if arctic else []
    for name, make, depth in settings:
        (on_agent,) = replay([make(depth, 100000)], agent, args.k)
        (on_corpus,) = replay([make(depth, 100000)], corpus, args.k)
        print(f"{name:9} d{depth:<3} agent {on_agent['tokens_per_step']:6.2f} / {on_agent['acceptance']:5.1%}"
              f"   corpus {on_corpus['tokens_per_step']:6.2f} / {on_corpus['acceptance']:5.1%}")

    stream = [token for prompt, response in corpus for token in prompt + response]
    while len(stream) < 32768 + 200:
        stream += stream
    index_cost, rescan_cost = ngram_costs(stream[:32768 + 200])
    print(f"\nn-gram at a 32k context, per step: incremental index {index_cost * 1e6:.2f} us, "
          f"full rescan {rescan_cost * 1e6:.2f} us, ratio {index_cost / rescan_cost:.4f}")
    return 0
