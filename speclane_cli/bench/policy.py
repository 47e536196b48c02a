"""`speclane bench policy`: draft policies replayed on the target's own outputs, without noise.

The target's greedy replies to the bench data sets are recorded once (transformers, the same chat template and
conversations as `bench serve`) and saved; each policy then replays them through the compiled drafter core as the
gateway drives it: a drafter session per request (the data set's requests in order, one tenant, so the global
tree learns as it would at concurrency 1), each step planned by the gateway's own step planner
(gateway/planner.py), its draft verified greedily (accepted up to the first token the target did not write, plus
the target's own next token), and with next-round drafts the planner's offers used as the next step's draft
when the step ends as one of them foresaw.

Steps are priced as the verifier measures them (`draft_cost.py`): a plain step costs 1, each draft token
`--draft-token-cost` more, so a policy's decode speed relative to n-gram lookup is estimated exactly from counts.
Greedy verification makes the replay deterministic: it finds the knobs, and `bench serve` confirms the winners.
"""

import json
import pathlib
from dataclasses import dataclass

from drafter_service.engine import DraftEngine, step_budget
from drafter_service.service import draft_to_proto
from gateway.estimates import MethodAcceptance, RequestAcceptance
from gateway.planner import Measurements, PlannerPolicy, StepState, draft_budget, plan_step
from protos.common.v1 import common_pb2
from speclane.speculation import DrafterLimits, SpeculationSettings
from speclane.tokens import common_prefix


@dataclass(frozen=True)
class Trace:
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass
class Replayed:
    tokens: int = 0  # decoded after the first (which the prefill gives)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    next_round_steps: int = 0
    cost: float = 0.0  # in plain-step units

    @property
    def speed(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0


def replay(traces: list[Trace], settings: SpeculationSettings, token_cost: float,
           next_round: bool = True, break_even: bool = False) -> Replayed:
    """Decodes every trace with the drafter's drafts under `settings` (suffix or ngram) and counts what it costs.
    Each step is planned by the gateway's own step planner (gateway/planner.py) at one sequence's load, with
    `break_even`, each draft cut where it stops paying at `token_cost`; the verifier's lookups are left out
    (they trade the round trip's wait, which this replay does not price)."""
    limits = DrafterLimits()
    engine = DraftEngine(limits.max_tree_depth, limits.max_cached_requests)
    k = settings.num_speculative_tokens
    # As the gateway asks: each draft going on past its step, for the drafter's guess of the bonus token and k more.
    lookahead = min(k + 1, limits.max_speculative_tokens) if next_round else 0
    policy = PlannerPolicy(draft_token_costs=((1, token_cost),), next_round=next_round, lookup="off",
                           break_even=break_even)
    method_acceptance = MethodAcceptance()
    result = Replayed()
    for trace in traces:
        out = trace.output
        seq_id = engine.start(trace.prompt, settings, tenant="", lookahead=lookahead)
        acceptance = RequestAcceptance(method_acceptance) if break_even else None
        position, withheld, offered, cut_steps = 1, list(out[:1]), (), 0
        while position < len(out):
            committed_len = len(trace.prompt) + position
            # The verifier runs ahead where the step ends as one of the offers foresaw.
            ran_ahead = any(c.draft.committed_len == committed_len and c.bonus_token_id == withheld[-1]
                            for c in offered)
            state = StepState(settings.method, k, next_round, ran_ahead, None, committed_len, withheld[-1], offered,
                              next_round, settings.suffix_decoding_max_spec_factor,
                              settings.suffix_decoding_min_token_prob)
            measured = Measurements(1, token_cost, token_cost, acceptance.rates(k) if acceptance else None,
                                    cut_steps, None, False)
            budget = draft_budget(policy, state, measured)
            drafted = common_pb2.Draft()
            if budget.ask_drafter:
                core_draft = engine.core.step([seq_id], [withheld],
                                              [step_budget(budget.max_spec_factor, budget.min_token_prob)])[0]
                drafted, withheld = draft_to_proto(core_draft, committed_len), []
            step = plan_step(state, measured, budget, drafted, None)
            offered, cut_steps = step.offers, budget.cut_steps
            result.next_round_steps += ran_ahead
            draft = step.draft.token_ids
            accepted = common_prefix(draft, out[position:])
            if acceptance is not None:
                acceptance.observe(len(draft), accepted)
            committed = list(out[position:position + accepted + 1])
            withheld += committed
            position += len(committed)
            result.steps += 1
            result.drafted += len(draft)
            result.accepted += accepted
            result.cost += 1 + token_cost * len(draft)
        engine.end(seq_id)
        result.tokens += len(out) - 1
    return result


def record(path: pathlib.Path, datasets: list[str], num_prompts: int, max_turns: int, max_tokens: int,
           seed: int) -> dict[str, list[Trace]]:
    """The packaged model's greedy replies to the bench conversations, saved to `path` as JSON."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speclane.models import resolve_model
    from speclane_cli.bench.workloads import load_workload

    model_dir = str(resolve_model("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    recorded = {}
    for name in datasets:
        traces = []
        for conversation in load_workload(name, num_prompts, seed, max_turns):
            replies: list[str] = []
            for _ in conversation.turns:
                prompt = tokenizer.apply_chat_template(conversation.messages(replies), add_generation_prompt=True,
                                                       return_dict=True)["input_ids"]
                with torch.inference_mode():
                    generated = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                               pad_token_id=tokenizer.eos_token_id)
                output = generated[0, len(prompt):].tolist()
                traces.append(Trace(tuple(prompt), tuple(output)))
                replies.append(tokenizer.decode(output, skip_special_tokens=True))
        recorded[name] = traces
    path.write_text(json.dumps({name: [[list(t.prompt), list(t.output)] for t in traces]
                                for name, traces in recorded.items()}))
    return recorded


def load(path: pathlib.Path) -> dict[str, list[Trace]]:
    return {name: [Trace(tuple(prompt), tuple(output)) for prompt, output in traces]
            for name, traces in json.loads(path.read_text()).items()}


def add_arguments(parser) -> None:
    parser.add_argument("--traces", default="bench-traces.json",
                        help="recorded replies (JSON); recorded first with the packaged model when absent")
    parser.add_argument("--dataset", default="humaneval,sharegpt,agent-loop,code-edit",
                        help="comma-separated bench serve data sets (when recording)")
    parser.add_argument("--num-prompts", type=int, default=10, help="conversations per data set (when recording)")
    parser.add_argument("--max-turns", type=int, default=2, help="turns per conversation (when recording)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (when recording)")
    parser.add_argument("--seed", type=int, default=0, help="data set seed (when recording)")
    parser.add_argument("--k", default="8,12,16,24", help="comma-separated suffix draft lengths to try")
    parser.add_argument("--max-spec-factor", default="1,2", help="comma-separated suffix budgets per match token")
    parser.add_argument("--min-token-prob", default="0.1,0.3", help="comma-separated suffix probability floors")
    parser.add_argument("--ngram-k", type=int, default=8, help="n-gram lookup's draft length, the reference")
    parser.add_argument("--draft-token-cost", type=float, default=0.17,
                        help="a draft token's verify cost relative to a plain step (the verifier logs its own)")
    parser.add_argument("--no-next-round", action="store_true", help="replay without next-round drafts")
    parser.add_argument("--break-even", action="store_true",
                        help="cut both methods' drafts where they stop paying, as the gateway ships")


def run(args) -> int:
    path = pathlib.Path(args.traces)
    datasets = [name for name in args.dataset.split(",") if name]
    traces = load(path) if path.exists() else record(path, datasets, args.num_prompts, args.max_turns,
                                                        args.max_tokens, args.seed)
    floats = lambda text: [float(value) for value in text.split(",")]  # noqa: E731
    grid = [(k, factor, floor) for k in (int(value) for value in args.k.split(","))
            for factor in floats(args.max_spec_factor) for floor in floats(args.min_token_prob)]
    cost, next_round, break_even = args.draft_token_cost, not args.no_next_round, args.break_even
    names = list(traces)
    print(f"suffix decoding's estimated decode speed / n-gram lookup's (k={args.ngram_k}), draft token cost "
          f"{cost:.2f}, next round {'on' if next_round else 'off'}, break-even cut {'on' if break_even else 'off'}")
    print("| k | max_spec_factor | min_token_prob | " + " | ".join(names) + " | worst |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    ngram = SpeculationSettings(method="ngram", num_speculative_tokens=args.ngram_k)
    reference = {name: replay(traces[name], ngram, cost, next_round, break_even).speed for name in names}
    for k, factor, floor in grid:
        suffix = SpeculationSettings(method="suffix", num_speculative_tokens=k,
                                     suffix_decoding_max_spec_factor=factor, suffix_decoding_min_token_prob=floor)
        ratios = [replay(traces[name], suffix, cost, next_round, break_even).speed / reference[name]
                  for name in names]
        print(f"| {k} | {factor:g} | {floor:g} | " + " | ".join(f"{r:.3f}" for r in ratios)
              + f" | {min(ratios):.3f} |")
    return 0
