"""What a deployment file may set for a service: the service's own flags as environment
variables (SPECLANE_<SERVICE>_<FLAG>), mapped to its config dataclass, and the few variables
of the platform underneath. Shared by the compose and the Kubernetes tests."""

import contextlib
import os

import pytest

from drafter_service.config import ENV_PREFIX as DRAFTER_PREFIX
from drafter_service.config import DrafterConfig
from gateway.config import ENV_PREFIX as GATEWAY_PREFIX
from gateway.config import GatewayConfig
from speclane.config import parse_config, settable_fields
from verifier_service.config import ENV_PREFIX as VERIFIER_PREFIX
from verifier_service.config import VerifierConfig

# `speclane <command>` -> (config dataclass, env prefix)
SERVICE_CONFIGS = {
    "drafter": (DrafterConfig, DRAFTER_PREFIX),
    "verifier": (VerifierConfig, VERIFIER_PREFIX),
    "gateway": (GatewayConfig, GATEWAY_PREFIX),
}
# Read by every command (speclane.fetch.speclane_home): where models and data sets live.
COMMON = {"SPECLANE_HOME"}
# The verifier on Ascend NPUs: the runtime's device list, torch_npu's task queue, HCCL's mode.
ASCEND = {"ASCEND_RT_VISIBLE_DEVICES", "TASK_QUEUE_ENABLE", "HCCL_OP_EXPANSION_MODE"}
# The host's Ascend driver, mounted read-only as the vllm-ascend tutorial's `docker run` does.
ASCEND_DRIVER_PATHS = [
    "/usr/local/dcmi",
    "/usr/local/Ascend/driver/tools/hccn_tool",
    "/usr/local/bin/npu-smi",
    "/usr/local/Ascend/driver/lib64",
    "/usr/local/Ascend/driver/version.info",
    "/etc/ascend_install.info",
    "/etc/hccn.conf",
]
ALLOWED_OTHERS = {"drafter": COMMON, "gateway": COMMON, "verifier": COMMON | ASCEND, "pull": COMMON}


def flag_variables(command: str) -> set[str]:
    """Every SPECLANE_<SERVICE>_<FLAG> variable `speclane <command>` reads."""
    if command not in SERVICE_CONFIGS:
        return set()
    config_cls, prefix = SERVICE_CONFIGS[command]
    return {prefix + field.name.upper() for field in settable_fields(config_cls)}


def unknown_variables(command: str, names) -> list[str]:
    """The names `speclane <command>` would ignore: typos, another service's flags, stray variables."""
    known = flag_variables(command) | ALLOWED_OTHERS.get(command, set())
    return sorted(set(names) - known)


def any_flag_variable(name: str) -> bool:
    return any(name in flag_variables(command) for command in SERVICE_CONFIGS)


@contextlib.contextmanager
def only_environment(environment: dict[str, str]):
    """os.environ with no SPECLANE_* variable but `environment`'s, restored afterwards."""
    saved = dict(os.environ)
    try:
        for name in [name for name in os.environ if name.startswith("SPECLANE_")]:
            del os.environ[name]
        os.environ.update(environment)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def build_config(command: str, environment: dict[str, str]):
    """The config `speclane <command>` builds from `environment` alone (no flags), as the
    service would at start; fails the test with the service's own usage error otherwise."""
    config_cls, prefix = SERVICE_CONFIGS[command]
    with only_environment({name: value for name, value in environment.items() if value is not None}):
        try:
            return parse_config(config_cls, prefix, [], prog=f"speclane {command}")
        except SystemExit:
            pytest.fail(f"`speclane {command}` refuses the settings {environment}")
