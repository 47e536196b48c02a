"""`speclane bench soak`: hours of traffic in minutes. `--concurrency` clients send a
mix of chat requests (HumanEval and ShareGPT prompts, streamed and whole, greedy and
sampled, stop strings, speculation methods, streams left early) for `--duration`,
while the resident memory of every service process is sampled. It passes when no
request failed (a deliberate disconnect is not a failure), every service stayed up,
each one's RSS stayed flat after the warm-up, and once the load stops nothing is
held: no generation on the gateway, no sequence or KV on the verifier, no drafter
session. Writes soak.json and soak.md; exits 1 if a check failed.

Without --url it starts drafter, verifier and gateway itself on loopback, with
metrics ports on and caches sized to fill during the warm-up (see `_own_configs`)."""

import asyncio
import pathlib
import re
import shlex
import sys
import time
import urllib.parse

from speclane.models import DEFAULT_MODEL

DEFAULT_SPECULATIVE_CONFIG = '{"method": "suffix", "num_speculative_tokens": 8}'
LOOPBACK = ("127.0.0.1", "localhost", "::1")
KV_BLOCK = 16  # the verifier's block size in the stack started here
PROMPT_ALLOWANCE_TOKENS = 256  # per client, beside max_tokens: twice the median prompt (the longest is 435)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """'45s', '10m', '1h' or plain seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match or float(match[1]) <= 0:
        raise ValueError(f"expected a duration like 45s, 10m or 1h, got {text!r}")
    return float(match[1]) * _UNITS[match[2]]


def add_arguments(parser) -> None:
    parser.add_argument("--url", default="", help="gateway of a running stack on this host (its processes are "
                                                  "found in /proc); empty: start one on loopback")
    parser.add_argument("--concurrency", type=int, default=64, help="clients, each sending its next request "
                                                                    "as soon as the last one ends")
    parser.add_argument("--duration", default="10m", help="how long new requests are sent: 45s, 10m, 1h")
    parser.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens of a request (each draws "
                                                                    "one between a quarter of it and it)")
    parser.add_argument("--dataset", default="humaneval,sharegpt", help="comma-separated prompt sources "
                                                                        "(as speclane bench serve takes them)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1,
                        help="share of requests that are streams the client leaves after 1 to 4 chunks")
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--rss-tolerance", type=float, default=0.10,
                        help="largest growth of a service's median RSS from the second third of the run to "
                             "the last (the first third is the warm-up)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds the stack may take to hold nothing once the load stops")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--output-dir", default="bench-results/soak", help="where soak.json, soak.md (and the "
                                                                            "logs of a stack started here) go")
    running = parser.add_argument_group("a running stack (--url)")
    running.add_argument("--pids", default="", help="gateway=PID,verifier=PID,drafter=PID; default: found in "
                                                    "/proc from the gateway's command line")
    running.add_argument("--verifier-address", default="", help="host:port for the verifier's GetLoad; default: "
                                                                "from its command line")
    running.add_argument("--drafter-metrics-url", default="", help="the drafter's /metrics (for its sessions); "
                                                                   "default: from its --metrics-port")
    own = parser.add_argument_group("the stack started here (no --url)")
    own.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name or model directory")
    own.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE_CONFIG, help="the gateway's default")
    own.add_argument("--num-gpu-blocks-override", type=int, default=0,
                     help=f"the verifier's KV blocks (of {KV_BLOCK} tokens); 0: enough for concurrency x "
                          f"(max-tokens + {PROMPT_ALLOWANCE_TOKENS})")
    own.add_argument("--drafter-max-cached-requests", type=int, default=0,
                     help="responses the drafter's global tree keeps; 0: 2 x concurrency")


def _settings(args) -> dict:
    settings = {"url": args.url.rstrip("/").removesuffix("/v1"), "concurrency": args.concurrency,
                "duration_s": parse_duration(args.duration), "max_tokens": args.max_tokens,
                "datasets": [name.strip() for name in args.dataset.split(",") if name.strip()],
                "disconnect_fraction": args.disconnect_fraction, "sample_interval_s": args.sample_interval,
                "rss_tolerance": args.rss_tolerance, "drain_timeout_s": args.drain_timeout, "seed": args.seed,
                "output_dir": args.output_dir}
    if min(args.concurrency, args.max_tokens) < 1 or not args.sample_interval > 0 or args.drain_timeout < 0:
        raise ValueError("--concurrency and --max-tokens must be >= 1, --sample-interval > 0, --drain-timeout >= 0")
    if not 0 <= args.disconnect_fraction < 1 or args.rss_tolerance < 0:
        raise ValueError("--disconnect-fraction must be in [0, 1) and --rss-tolerance >= 0")
    if not settings["datasets"]:
        raise ValueError("--dataset names no data set")
    settings["start_stack"] = not settings["url"]
    if settings["url"]:
        if urllib.parse.urlsplit(settings["url"]).hostname not in LOOPBACK:
            raise ValueError("--url must be a loopback address: the service processes are watched through /proc")
        settings.update(pids=_pids(args.pids), verifier_address=args.verifier_address,
                        drafter_metrics_url=args.drafter_metrics_url)
    else:
        settings.update(model=args.model, speculative_config=args.speculative_config,
                        num_gpu_blocks_override=args.num_gpu_blocks_override or args.concurrency * -(
                            -(args.max_tokens + PROMPT_ALLOWANCE_TOKENS) // KV_BLOCK),
                        drafter_max_cached_requests=args.drafter_max_cached_requests or 2 * args.concurrency,
                        max_concurrent_requests=2 * args.concurrency)
    return settings


def _pids(text: str) -> dict[str, int]:
    pids = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, pid = part.partition("=")
        if name not in ("gateway", "verifier", "drafter") or not pid.isdigit():
            raise ValueError(f"--pids takes gateway=PID,verifier=PID,drafter=PID, got {part!r}")
        pids[name] = int(pid)
    return pids


def command_line(settings: dict) -> str:
    flags = {"--url": settings["url"], "--concurrency": settings["concurrency"],
             "--duration": f"{settings['duration_s']:g}s", "--max-tokens": settings["max_tokens"],
             "--dataset": ",".join(settings["datasets"]), "--disconnect-fraction": settings["disconnect_fraction"],
             "--sample-interval": settings["sample_interval_s"], "--rss-tolerance": settings["rss_tolerance"],
             "--drain-timeout": settings["drain_timeout_s"], "--seed": settings["seed"],
             "--output-dir": settings["output_dir"]}
    if settings["start_stack"]:
        del flags["--url"]
        flags.update({"--model": settings["model"], "--speculative-config": settings["speculative_config"],
                      "--num-gpu-blocks-override": settings["num_gpu_blocks_override"],
                      "--drafter-max-cached-requests": settings["drafter_max_cached_requests"]})
    return "speclane bench soak " + " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in flags.items())


def _own_configs(settings: dict) -> dict:
    """The services as `speclane serve` configures them, but with metrics ports on (the
    drafter's sessions are read there), room for twice the clients at the gateway (a
    client that leaves frees its slot a moment after its next request arrives), and
    caches small enough to fill during the warm-up: the verifier's default KV budget
    (0.4 of free RAM) and the drafter's 10000 cached responses would still be growing,
    by design, at the end of a 10-minute run, which no RSS check could tell from a leak."""
    from drafter_service.config import DrafterConfig
    from gateway.config import GatewayConfig
    from speclane.models import resolve_model, served_name
    from speclane.net import free_port
    from verifier_service.config import VerifierConfig

    model_dir, name = str(resolve_model(settings["model"])), served_name(settings["model"])
    drafter = DrafterConfig(address=f"127.0.0.1:{free_port()}", metrics_port=free_port(),
                            max_cached_requests=settings["drafter_max_cached_requests"])
    verifier = VerifierConfig(model=model_dir, model_name=name, address=f"127.0.0.1:{free_port()}",
                              metrics_port=free_port(), num_gpu_blocks_override=settings["num_gpu_blocks_override"],
                              kv_block_size=KV_BLOCK)
    gateway = GatewayConfig(model=model_dir, served_model_name=name, port=free_port(),
                            grpc_address=f"127.0.0.1:{free_port()}", drafter_address=drafter.address,
                            verifier_addresses=(verifier.address,), speculative_config=settings["speculative_config"],
                            max_concurrent_requests=settings["max_concurrent_requests"])
    return {"drafter": drafter, "verifier": verifier, "gateway": gateway}


def _services(settings: dict):
    from speclane_cli.bench.soak_watch import discover, start_stack

    if settings["start_stack"]:
        services = start_stack(_own_configs(settings), pathlib.Path(settings["output_dir"]) / "logs")
        settings["url"] = services.url
        return services
    services = discover(settings["url"], settings["pids"], settings["verifier_address"],
                        settings["drafter_metrics_url"])
    missing = {"gateway", "verifier"} - set(services.pids)
    if missing:
        raise ValueError(f"no {' or '.join(sorted(missing))} process found for {settings['url']}; name them "
                         "with --pids")
    if not services.drafter_metrics_url:
        print("speclane bench soak: warning: the drafter's sessions are not measured (no --metrics-port); "
              "give --drafter-metrics-url", file=sys.stderr)
    return services


async def _progress(outcomes: list, series: dict, start: float, done: asyncio.Event) -> None:
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), 30)
        except TimeoutError:
            errors = sum(not o.ok for o in outcomes)
            memory = ", ".join(f"{name} {points[-1][1] / 2**20:.0f} MiB" for name, points in series.items()
                               if points and points[-1][1] is not None)
            print(f"[{time.perf_counter() - start:6.0f} s] {len(outcomes)} requests, {errors} errors; RSS {memory}",
                  file=sys.stderr, flush=True)


async def _soak(settings: dict, services, prompts: list[str], model: str):
    from speclane_cli.bench.soak_load import run_load
    from speclane_cli.bench.soak_watch import sample, wait_until_idle

    outcomes, series, kv, done = [], {}, [], asyncio.Event()
    start = time.perf_counter()
    sampler = asyncio.create_task(sample(services, settings["sample_interval_s"], asyncio.get_running_loop().time(),
                                         done, series, kv))
    progress = asyncio.create_task(_progress(outcomes, series, start, done))
    try:
        await run_load(settings["url"], model, prompts, settings["concurrency"], settings["duration_s"],
                       settings["max_tokens"], settings["disconnect_fraction"], settings["seed"], start, outcomes)
    finally:
        done.set()
        await asyncio.gather(sampler, progress)
    idle = await wait_until_idle(services, settings["drain_timeout_s"])
    return outcomes, series, kv, idle


def run(args) -> int:
    from speclane_cli.bench.client import ServerUnreachable, served_models
    from speclane_cli.bench.soak_report import checks, kv_fill, rss_trend, summarize, write_report
    from speclane_cli.bench.workloads import load_workload

    try:
        settings = _settings(args)
        prompts = [c.turns[0] for name in settings["datasets"] for c in load_workload(name, 200, settings["seed"], 1)]
        services = _services(settings)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"speclane bench soak: error: {error}", file=sys.stderr)
        return 2
    try:
        model = served_models(settings["url"])[0]
        print(f"soak: {settings['concurrency']} clients for {settings['duration_s']:g} s against {settings['url']} "
              f"(pids {services.pids})", file=sys.stderr, flush=True)
        outcomes, series, kv, idle = asyncio.run(_soak(settings, services, prompts, model))
        alive = {name: all(rss is not None for _, rss in series.get(name, ())) and services.running(name)
                 for name in services.pids}
    except ServerUnreachable as error:
        print(f"speclane bench soak: error: {error}", file=sys.stderr)
        return 2
    finally:
        services.stop()
    summary = summarize(outcomes)
    summary["verifier_kv"] = kv_fill(kv)
    rss = {name: rss_trend(points, settings["duration_s"]) for name, points in series.items()}
    found = checks(summary, rss, alive, idle, settings["rss_tolerance"])
    written = write_report(pathlib.Path(settings["output_dir"]), command_line(settings), settings, services.pids,
                           summary, rss, series, found)
    print(pathlib.Path(written[1]).read_text())
    for check in found:
        if not check.ok:
            print(f"FAILED: {check.name}: {check.detail}", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)))
    return 0 if all(check.ok for check in found) else 1
