"""`speclane bench drafter --service`: how many verifiers one drafter process
keeps up with. It starts a drafter (`python -m drafter_service`) and drives it
over gRPC as gateways do, with the sessions of N simulated verifiers: each
verifier runs `--sequences` sequences on one Drafter.Sessions stream, and at
every verifier pass (`--verifier-step-rate`: a verifier's measured steps per
second over all its sequences) each of them steps, all in one message. A
sequence replays a real response greedily, as the target would have written
it: it commits the tokens of the draft that match the response, plus one,
sends them with its next step, and makes way for the next response when its
own ends, so the global tree learns from every session.

Each level reports the steps per second the drafter answered, the draft
latency a step saw (its pass's message written to its answer read, p50 /
p99), and the drafter process's CPU per step, read from /proc. The load comes
from `--client-processes` processes on the same host, so on a small machine
they take CPU the drafter could use; the CPU per step says what the drafter
itself needs."""

import asyncio
import itertools
import json
import multiprocessing
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from queue import Empty

import grpc

from gateway.planner import suffix_budget
from protos.conventions import CHANNEL_OPTIONS
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.speculation import SpeculationSettings, settings_to_proto
from speclane.tokens import common_prefix

# Steps a second of one SmolLM2-135M verifier with 32 sequences, suffix decoding, on this host: the highest of
# the three data sets in docs/benchmarks/vllm-cpu (run 11: ShareGPT, 344.6 tokens/s at 1.50 tokens a step).
SMOLLM2_C32_STEPS_PER_SECOND = 230.0


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--service: one drafter process under many verifiers' sessions")
    group.add_argument("--service", action="store_true", help="measure the drafter service over gRPC instead")
    group.add_argument("--verifiers", default="1,8,16,32,48", help="simulated verifiers per level, comma-separated")
    group.add_argument("--sequences", type=int, default=32, help="sequences each verifier runs at once")
    group.add_argument("--verifier-step-rate", type=float, default=SMOLLM2_C32_STEPS_PER_SECOND,
                       help="one verifier's steps per second over all its sequences")
    group.add_argument("--seconds", type=float, default=15.0, help="measured seconds per level")
    group.add_argument("--warmup-seconds", type=float, default=3.0, help="seconds per level before measuring")
    group.add_argument("--client-processes", type=int, default=1, help="processes generating the load")
    group.add_argument("--method", default="suffix", choices=("suffix", "ngram"))
    group.add_argument("--draft-token-cost", type=float, default=None,
                       help="send each suffix step the budget a gateway's planner sends at this draft-token cost "
                            "(gateway.planner.suffix_budget; SmolLM2 with 32 sequences measured 0.24-0.37 here); "
                            "unset: the session's budget, what a gateway sends a verifier with no measured cost")
    group.add_argument("--drafter-args", default="", help="extra flags for the drafter process")
    group.add_argument("--output-dir", default="", help="write results.json and results.md here")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _start_drafter(port: int, extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "drafter_service", "--address", f"127.0.0.1:{port}", "--max-sessions", "100000",
            "--log-level", "warning", *extra.split()]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for _ in range(600):  # serving once GetInfo answers
            try:
                stub.GetInfo(drafter_pb2.GetInfoRequest(), timeout=5)
                return process
            except grpc.RpcError:
                time.sleep(0.1)
    finally:
        channel.close()
    process.kill()
    raise RuntimeError("the drafter did not start")


class _Replay:
    """One sequence replaying a response greedily: what it commits with its next step."""

    def __init__(self, number: int, prompt: list[int], response: list[int]):
        self.number, self.prompt, self.response = number, prompt, response
        self.committed_len, self.position, self.send = len(prompt), 1, response[:1]  # the prefill's token

    def step(self, budget: dict) -> drafter_pb2.Step:
        self.committed_len += len(self.send)
        return drafter_pb2.Step(committed_token_ids=self.send, committed_len=self.committed_len, **budget)

    def answered(self, draft) -> None:
        accepted = common_prefix(list(draft.token_ids[:draft.step_len or None]), self.response[self.position:])
        self.send = self.response[self.position:self.position + accepted + 1]
        self.position += len(self.send)


async def _verifier(stub, items, sequences: int, params, budget: dict, interval: float, first_delay: float,
                    measure_from: float, stop_at: float, latencies: list[float], counts: dict) -> None:
    """A verifier's `sequences` sequences on one Sessions stream, as a gateway runs them: every
    `interval` seconds (a pass) each steps, all in one message; a finished one makes way for the next."""
    Entry = drafter_pb2.SessionsRequest.Entry  # noqa: N806 - a message class
    await asyncio.sleep(first_delay)
    clock = time.perf_counter
    call = stub.Sessions()
    running: list[_Replay] = []
    while clock() < stop_at:
        entries = []
        for replay in [r for r in running if not r.send]:
            running.remove(replay)
            entries.append(Entry(session=replay.number, end=drafter_pb2.End()))
        while len(running) < sequences:
            number, (prompt, response) = next(items)
            replay = _Replay(number, prompt, response)
            running.append(replay)
            entries.append(Entry(session=number, start=drafter_pb2.Start(
                sequence_id=str(number), prompt_token_ids=prompt, params=params, tenant="bench",
                num_lookahead_tokens=min(params.num_speculative_tokens + 1, 64))))
        entries += [Entry(session=replay.number, step=replay.step(budget)) for replay in running]
        sent = clock()
        await call.write(drafter_pb2.SessionsRequest(entries=entries))
        answers = await call.read()
        if answers is grpc.aio.EOF or any(answer.code for answer in answers.entries):
            raise RuntimeError(f"the drafter refused a step: {answers}")
        took = clock() - sent
        by_number = {answer.session: answer.draft for answer in answers.entries}
        for replay in running:
            replay.answered(by_number[replay.number])
        if sent >= measure_from:
            latencies += [took] * len(running)
            counts["drafted"] += sum(len(draft.token_ids) for draft in by_number.values())
        await asyncio.sleep(max(0.0, interval - took))  # the verifier's pass
    await call.done_writing()
    call.cancel()


def _client(address: str, streams: list, verifiers: int, offset: int, sequences: int, interval: float, method: str,
            draft_token_cost: float | None, warmup: float, seconds: float, queue) -> None:
    """One load process: `verifiers` verifiers, their first passes spread over one interval."""
    async def main():
        settings = SpeculationSettings(method=method).with_draft_length(None)
        params = settings_to_proto(settings)  # as a gateway does
        budget = {}
        if draft_token_cost is not None and method == "suffix":  # the planner's, as the gateway's loop calls it
            factor, min_prob = suffix_budget(draft_token_cost, settings.suffix_decoding_max_spec_factor,
                                             settings.suffix_decoding_min_token_prob)
            budget = dict(max_spec_factor=factor, min_token_prob=min_prob)
        latencies, counts = [], {"drafted": 0}
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            now = time.perf_counter()
            measure_from, stop_at = now + warmup, now + warmup + seconds
            numbered = list(enumerate(streams))
            tasks = [_verifier(stub, itertools.islice(itertools.cycle(numbered), (offset + v) * 7919, None), sequences,
                               params, budget, interval, interval * v / verifiers, measure_from, stop_at, latencies,
                               counts)
                     for v in range(verifiers)]
            await asyncio.gather(*tasks)
        queue.put((latencies, counts["drafted"]))

    asyncio.run(main())


def run_level(address: str, drafter_pid: int, streams: list, verifiers: int, args) -> dict:
    sequences = verifiers * args.sequences
    interval = args.sequences / args.verifier_step_rate  # each sequence steps once per verifier pass
    processes = max(1, min(args.client_processes, verifiers))
    context = multiprocessing.get_context("spawn")  # gRPC's state does not survive a fork
    queue = context.Queue()
    share = [verifiers // processes + (p < verifiers % processes) for p in range(processes)]
    workers = [context.Process(target=_client, args=(address, streams, share[p], sum(share[:p]), args.sequences,
                                                     interval, args.method, args.draft_token_cost,
                                                     args.warmup_seconds, args.seconds, queue))
               for p in range(processes)]
    for worker in workers:
        worker.start()
    time.sleep(args.warmup_seconds)
    cpu_before, wall_before = _cpu_seconds(drafter_pid), time.perf_counter()
    results, give_up_at = [], time.monotonic() + args.seconds + 60
    while len(results) < len(workers):
        try:
            results.append(queue.get(timeout=1.0))
        except Empty:
            if any(worker.exitcode not in (None, 0) for worker in workers) or time.monotonic() > give_up_at:
                for worker in workers:
                    worker.kill()
                raise RuntimeError("a load process failed or hung") from None
    cpu, wall = _cpu_seconds(drafter_pid) - cpu_before, time.perf_counter() - wall_before
    for worker in workers:
        worker.join()
    latencies = sorted(latency for part, _ in results for latency in part)
    steps = len(latencies)
    return dict(verifiers=verifiers, sequences=sequences, offered_steps_per_second=sequences / interval,
                steps_per_second=steps / args.seconds, drafted_per_step=sum(d for _, d in results) / max(steps, 1),
                p50_ms=1e3 * statistics.median(latencies) if latencies else None,
                p99_ms=1e3 * latencies[int(0.99 * (steps - 1))] if latencies else None,
                drafter_cpu_ms_per_step=1e3 * cpu / max(steps, 1), drafter_cores=cpu / wall)


def _table(rows: list[dict], args) -> str:
    lines = ["| verifiers | sequences | offered steps/s | answered steps/s | drafted/step | p50 ms | p99 ms "
             "| drafter CPU ms/step | drafter cores |", "|" + " --: |" * 9]
    for row in rows:
        lines.append(f"| {row['verifiers']} | {row['sequences']} | {row['offered_steps_per_second']:.0f} "
                     f"| {row['steps_per_second']:.0f} | {row['drafted_per_step']:.1f} | {row['p50_ms']:.2f} "
                     f"| {row['p99_ms']:.2f} | {row['drafter_cpu_ms_per_step']:.3f} | {row['drafter_cores']:.2f} |")
    return "\n".join(lines)


def run(args) -> int:
    from speclane_cli.bench.drafter import _streams

    corpus, agent = _streams(args)
    streams = [(prompt, response) for prompt, response in corpus + agent if len(response) > 1]
    port = _free_port()
    drafter = _start_drafter(port, args.drafter_args)
    rows = []
    try:
        for verifiers in (int(v) for v in args.verifiers.split(",")):
            rows.append(run_level(f"127.0.0.1:{port}", drafter.pid, streams, verifiers, args))
            print(_table(rows[-1:], args).splitlines()[-1], flush=True)
    finally:
        drafter.terminate()
        drafter.wait(30)
    command = "speclane bench drafter " + " ".join(sys.argv[3:])
    table = _table(rows, args)
    print(table)
    if args.output_dir:
        out = pathlib.Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(dict(command=command, args=vars(args), rows=rows), indent=1))
        (out / "results.md").write_text(f"```\n{command}\n```\n\n{table}\n")
    return 0
