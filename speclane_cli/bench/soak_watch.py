"""What `speclane bench soak` watches: the three service processes (found by pid,
started here, or discovered from /proc), their resident memory, and what the
stack still holds once the load stops (generations, verifier sequences and KV,
drafter sessions)."""

import asyncio
import contextlib
import dataclasses
import os
import pathlib
import subprocess
import sys
import urllib.parse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from speclane_cli.supervisor import terminate

SERVICE_MODULES = {"gateway": "gateway", "verifier": "verifier_service", "drafter": "drafter_service"}
_STOP_TIMEOUT_SECONDS = 30


@dataclasses.dataclass
class Services:
    """The stack under load: its processes, and where to read what it holds."""

    url: str  # http://host:port of the gateway
    pids: dict[str, int]  # service name -> pid
    verifier_address: str = ""  # host:port for GetLoad; empty: the gateway's /metrics alone
    drafter_metrics_url: str = ""  # empty: drafter sessions are not measured
    processes: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)  # started here

    def running(self, name: str) -> bool:
        """Whether the service still runs (its pid still exists, and a process started here has not exited)."""
        process = self.processes.get(name)
        return rss_bytes(self.pids[name]) is not None and (process is None or process.poll() is None)

    def stop(self) -> None:
        """Stops what this command started, gateway first (as `speclane serve` does)."""
        for process in reversed(self.processes.values()):
            terminate(process, _STOP_TIMEOUT_SECONDS)


def start_stack(configs: dict, log_dir: pathlib.Path) -> Services:
    """Starts drafter, verifier and gateway (configs by service name) on loopback as
    `speclane serve` would, but without its supervisor: a service that dies must fail
    the soak, not be restarted behind its back."""
    from speclane.config import to_argv
    from speclane.net import wait_http_ok
    from speclane_cli.supervisor import die_with_parent

    log_dir.mkdir(parents=True, exist_ok=True)
    services = Services(url=f"http://{configs['gateway'].host}:{configs['gateway'].port}", pids={},
                        verifier_address=configs["verifier"].address,
                        drafter_metrics_url=f"http://127.0.0.1:{configs['drafter'].metrics_port}/metrics")
    try:
        for name in ("drafter", "verifier", "gateway"):
            log = (log_dir / f"{name}.log").open("ab")
            process = subprocess.Popen([sys.executable, "-m", SERVICE_MODULES[name], *to_argv(configs[name])],
                                       stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            services.processes[name] = process
            services.pids[name] = process.pid
        wait_http_ok(f"{services.url}/health", services.processes["gateway"], timeout=600)
        for name, process in services.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"the {name} exited with {process.returncode}; see {log_dir}/{name}.log")
    except BaseException:
        services.stop()
        raise
    return services


def _flags(argv: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--")}


def _service_of(argv: list[str]) -> str | None:
    """Which speclane service a command line runs: `python -m MODULE`, `speclane NAME`
    or `python -m speclane_cli NAME`."""
    for name, module in SERVICE_MODULES.items():
        for arg, following in zip(argv, argv[1:]):
            if (arg == "-m" and following == module) or (
                    arg.rsplit("/", 1)[-1] in ("speclane", "speclane_cli") and following == name):
                return name
    return None


def _command_lines() -> dict[int, list[str]]:
    found = {}
    for path in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = path.read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        found[int(path.parent.name)] = argv
    return found


def discover(url: str, pids: dict[str, int], verifier_address: str, drafter_metrics_url: str) -> Services:
    """The services behind the gateway at `url`, from their command lines in /proc
    (what is given explicitly wins): the gateway listening on the URL's port, the
    verifier and drafter at the addresses its flags name."""
    lines = _command_lines()
    by_service: dict[str, list[int]] = {}
    for pid, argv in lines.items():
        if (name := _service_of(argv)) is not None:
            by_service.setdefault(name, []).append(pid)
    port = str(urllib.parse.urlsplit(url).port or 80)
    pids = dict(pids)
    if "gateway" not in pids:
        matches = [pid for pid in by_service.get("gateway", ()) if _flags(lines[pid]).get("--port") == port]
        if len(matches) == 1:
            pids["gateway"] = matches[0]
    gateway_flags = _flags(lines.get(pids.get("gateway"), []))
    wanted = {"verifier": gateway_flags.get("--verifier-addresses", "").split(",")[0],
              "drafter": gateway_flags.get("--drafter-address", "")}
    for name, address in wanted.items():
        matches = [pid for pid in by_service.get(name, ())
                   if address and _flags(lines[pid]).get("--address") == address]
        if name not in pids and len(matches) == 1:
            pids[name] = matches[0]
    if not verifier_address:
        verifier_address = _flags(lines.get(pids.get("verifier"), [])).get("--address", "")
    if not drafter_metrics_url:
        drafter = _flags(lines.get(pids.get("drafter"), []))
        if drafter.get("--metrics-port", "0") != "0":
            host = drafter.get("--address", "127.0.0.1:0").rsplit(":", 1)[0]
            host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "") else host
            drafter_metrics_url = f"http://{host}:{drafter['--metrics-port']}/metrics"
    return Services(url=url, pids=pids, verifier_address=verifier_address, drafter_metrics_url=drafter_metrics_url)


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (VmRSS), None once it is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


async def metric_samples(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Prometheus samples by name, summed over labels."""
    reply = await client.get(url)
    reply.raise_for_status()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


async def get_load(address: str):
    """The verifier's own GetLoad answer (an EngineLoad)."""
    import grpc

    from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        return await verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=10)


async def verifier_load(address: str) -> dict[str, int]:
    load = await get_load(address)
    return {"verifier_running": load.num_running, "verifier_waiting": load.num_waiting,
            "verifier_kv_used_tokens": load.kv_used_tokens}


async def held(services: Services, client: httpx.AsyncClient) -> dict[str, float]:
    """What the stack holds now; every figure is 0 when nothing runs. The gateway's
    /metrics always answers; GetLoad and the drafter's port only where known."""
    gateway = await metric_samples(client, f"{services.url}/metrics")
    figures = {"gateway_running": gateway.get("vllm:num_requests_running", 0.0),
               # the verifiers' load as the gateway last polled it (each second)
               "gateway_verifier_running": gateway.get("speclane:verifier_requests_running", 0.0),
               "gateway_kv_cache_usage": gateway.get("vllm:kv_cache_usage_perc", 0.0)}
    if services.verifier_address:
        figures.update(await verifier_load(services.verifier_address))
    if services.drafter_metrics_url:
        drafter = await metric_samples(client, services.drafter_metrics_url)
        figures["drafter_sessions"] = drafter.get("speclane:drafter_sessions", 0.0)
    return figures


async def wait_until_idle(services: Services, timeout: float) -> tuple[bool, dict[str, float]]:
    """Polls until nothing is held (True) or `timeout` seconds pass (False); the last figures."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        while True:
            try:
                figures = await held(services, client)
            except Exception as exc:  # noqa: BLE001 - a service that no longer answers holds what it held
                figures = {f"no answer ({type(exc).__name__})": 1.0}
            if not any(figures.values()):
                return True, figures
            if asyncio.get_running_loop().time() > deadline:
                return False, figures
            await asyncio.sleep(0.5)


async def sample(services: Services, interval: float, start: float, until: asyncio.Event,
                 rss: dict[str, list[tuple[float, int | None]]], kv: list[tuple[float, int, int]]) -> None:
    """Every `interval` s until `until` is set, appends per service (seconds since `start`,
    RSS or None once gone) to `rss`, and the verifier's KV held by running sequences and
    its prefix cache, with its budget, to `kv` (the RSS of a verifier follows it)."""
    import grpc

    loop = asyncio.get_running_loop()
    while True:
        now = round(loop.time() - start, 2)
        for name, pid in services.pids.items():
            rss.setdefault(name, []).append((now, rss_bytes(pid)))
        if services.verifier_address:
            with contextlib.suppress(grpc.RpcError):
                load = await get_load(services.verifier_address)
                kv.append((now, load.kv_used_tokens + load.kv_cached_tokens, load.kv_max_tokens))
        try:
            await asyncio.wait_for(until.wait(), interval)
            return
        except TimeoutError:
            pass
