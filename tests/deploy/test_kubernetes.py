"""The Kubernetes manifests, checked offline: each object validates (strictly: no unknown
fields) against the Kubernetes API schemas bundled with kubernetes-validate, and the set
holds to the deployment's rules: probes on every container, the verifier on 4 Ascend NPUs
with the node's driver mounted, environment variables that are real flags of the service
that gets them, and addresses that name a Service that exists."""

import pathlib
import re

import pytest
import yaml

from gateway.config import DNS_SCHEME
from tests.deploy.settings import ASCEND_DRIVER_PATHS, SERVICE_CONFIGS, build_config, flag_variables, unknown_variables

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install kubernetes-validate")

ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBE_DIR = ROOT / "compose" / "kubernetes"
# The oldest release the manifests promise to work on (native gRPC probes are GA since 1.27)
# and the newest whose schemas the package bundles.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
NPU_RESOURCE = "huawei.com/Ascend910"


def kustomization() -> dict:
    return yaml.safe_load((KUBE_DIR / "kustomization.yaml").read_text())


def objects() -> list[dict]:
    return [doc for name in kustomization()["resources"]
            for doc in yaml.safe_load_all((KUBE_DIR / name).read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects() if obj["kind"] == kind}


def deployment(name: str) -> dict:
    return by_kind("Deployment")[f"speclane-{name}"]


def pod_spec(name: str) -> dict:
    return deployment(name)["spec"]["template"]["spec"]


def main_container(name: str) -> dict:
    (container,) = pod_spec(name)["containers"]
    return container


def config_map() -> dict[str, str]:
    return by_kind("ConfigMap")["speclane-config"]["data"]


def environment(container: dict) -> dict[str, str]:
    """What the container sees: the ConfigMap (envFrom), then its own `env:` (which wins),
    with $(VAR) references expanded as the kubelet does."""
    env = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "speclane-config"
        env.update(config_map())
    for item in container.get("env", []):
        value = item["value"]
        for name, known in env.items():
            value = value.replace(f"$({name})", known)
        env[item["name"]] = value
    return env


ADAPTER_VALUES = KUBE_DIR / "prometheus-adapter-values.yaml"  # Helm values for prometheus-adapter, not an object


def test_kustomization_lists_every_manifest():
    listed = set(kustomization()["resources"])
    present = {path.name for path in KUBE_DIR.glob("*.yaml")} - {"kustomization.yaml", ADAPTER_VALUES.name}
    assert listed == present


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(version):
    problems = []
    for obj in objects():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:  # its str() carries the whole schema
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {'.'.join(map(str, error.path))}: "
                            f"{error.message}")
    assert not problems, "\n".join(problems)


def test_the_expected_objects_exist():
    services = {"speclane-drafter", "speclane-verifier", "speclane-gateway", "speclane-router"}
    assert set(by_kind("Deployment")) == set(by_kind("Service")) == services
    assert set(by_kind("HorizontalPodAutoscaler")) == {"speclane-gateway", "speclane-verifier"}
    assert set(by_kind("PersistentVolumeClaim")) == {"speclane-models", "speclane-drafter-state"}
    assert set(by_kind("ConfigMap")) == {"speclane-config"}


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_every_container_has_readiness_and_liveness_probes(name):
    for container in pod_spec(name)["containers"]:
        assert "readinessProbe" in container and "livenessProbe" in container, container["name"]
        # Model loads and waits for the verifier last minutes: a startup probe holds liveness off.
        assert "startupProbe" in container, container["name"]


@pytest.mark.parametrize("name", ["drafter", "verifier"])
def test_grpc_services_are_probed_with_grpc_health_on_their_listen_port(name):
    container = main_container(name)
    port = int(environment(container)[f"SPECLANE_{name.upper()}_ADDRESS"].rpartition(":")[2])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    served = {p["containerPort"] for p in container["ports"]}
    metrics = environment(container).get(f"SPECLANE_{name.upper()}_METRICS_PORT")
    assert served == {port} | ({int(metrics)} if metrics else set())


def test_gateway_readiness_is_http_health_and_liveness_its_own_grpc_health():
    container = main_container("gateway")
    env = environment(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(env["SPECLANE_GATEWAY_PORT"]),
                     "grpc": int(env["SPECLANE_GATEWAY_GRPC_ADDRESS"].rpartition(":")[2])}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Not /health: it answers 503 while the verifier is down, and that must not restart gateways.
    assert container["livenessProbe"]["grpc"]["port"] == ports["grpc"]


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_containers_run_speclane_with_settings_in_environment_only(name):
    container = main_container(name)
    assert container["command"] == ["speclane"] and container["args"] == [name]


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_every_variable_is_a_flag_of_the_service_it_is_given_to(name):
    container = main_container(name)
    own = [item["name"] for item in container.get("env", [])]
    assert not unknown_variables(name, own)
    assert environment(container)[f"SPECLANE_{name.upper()}_LOG_LEVEL"] == "info"


def test_config_map_keys_are_flags_or_the_model():
    for key in config_map():
        if key == "SPECLANE_MODEL":  # read by the init container and by $(SPECLANE_MODEL) in the verifier
            continue
        assert any(key in flag_variables(command) for command in SERVICE_CONFIGS), key


@pytest.mark.parametrize("name", ["drafter", "gateway"])
def test_every_service_accepts_its_settings(name):
    build_config(name, environment(main_container(name)))


def test_verifier_settings_name_the_model_on_the_volume():
    env = environment(main_container("verifier"))
    assert env["SPECLANE_VERIFIER_MODEL"] == config_map()["SPECLANE_MODEL"]
    assert env["SPECLANE_VERIFIER_MODEL"].startswith("/models/") and env["SPECLANE_HOME"] == "/models"
    assert env["SPECLANE_VERIFIER_DEVICE"] == "npu"
    # No ASCEND_RT_VISIBLE_DEVICES: the device plugin decides which NPUs the pod sees.
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env


def test_pods_disable_service_links():
    """Service links would inject SPECLANE_GATEWAY_PORT=tcp://... and the like into every pod,
    colliding with our SPECLANE_<SERVICE>_<FLAG> variables."""
    for name in ("drafter", "verifier", "gateway"):
        assert pod_spec(name)["enableServiceLinks"] is False, name


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_pods_run_as_non_root(name):
    assert pod_spec(name)["securityContext"]["runAsNonRoot"] is True
    for container in pod_spec(name)["containers"] + pod_spec(name).get("initContainers", []):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_verifier_requests_four_npus_for_four_ranks():
    resources = main_container("verifier")["resources"]
    assert int(resources["limits"][NPU_RESOURCE]) == 4
    assert int(config_map()["SPECLANE_VERIFIER_TENSOR_PARALLEL_SIZE"]) == 4
    assert pod_spec("verifier")["nodeSelector"] == {"speclane.io/role": "atlas"}
    assert deployment("verifier")["spec"]["strategy"]["type"] == "Recreate"


def test_verifier_mounts_the_node_driver_read_only_and_a_shm():
    spec, container = pod_spec("verifier"), main_container("verifier")
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {mount["mountPath"].rstrip("/"): mount for mount in container["volumeMounts"]}
    for path in ASCEND_DRIVER_PATHS:
        assert path in mounts, f"{path} is not mounted"
        assert mounts[path].get("readOnly") is True, path
        host_path = volumes[mounts[path]["name"]]["hostPath"]
        assert host_path["path"].rstrip("/") == path
        assert host_path["type"] in ("Directory", "File"), f"{path}: a missing path must fail the pod"
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["claimName"] == "speclane-models"


def test_model_init_fills_the_model_volume_before_the_verifier_starts():
    (init,) = pod_spec("verifier")["initContainers"]
    assert init["name"] == "model-init" and init["image"] == main_container("verifier")["image"]
    assert init["command"] + init["args"] == ["speclane", "pull", "$(SPECLANE_MODEL)"]
    assert environment(init)["SPECLANE_HOME"] == "/models"
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/models"}
    assert NPU_RESOURCE not in init["resources"].get("limits", {})


@pytest.mark.parametrize("name", ["drafter", "gateway"])
def test_cpu_services_run_on_cpu_nodes_from_the_light_image(name):
    assert pod_spec(name)["nodeSelector"] == {"speclane.io/role": "cpu"}
    assert main_container(name)["image"] == main_container("drafter")["image"]
    assert main_container(name)["image"] != main_container("verifier")["image"]
    assert NPU_RESOURCE not in main_container(name)["resources"].get("limits", {})


def test_drafter_keeps_its_snapshot_on_a_volume_with_one_writer():
    env = environment(main_container("drafter"))
    mounts = {m["mountPath"]: m["name"] for m in main_container("drafter")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec("drafter")["volumes"]}
    assert env["SPECLANE_DRAFTER_SNAPSHOT_PATH"] == "/state/trees.snapshot"
    assert volumes[mounts["/state"]]["persistentVolumeClaim"]["claimName"] == "speclane-drafter-state"
    assert deployment("drafter")["spec"]["replicas"] == 1
    assert deployment("drafter")["spec"]["strategy"]["type"] == "Recreate"


def test_services_select_their_pods_and_expose_the_listen_ports():
    for name, service in by_kind("Service").items():
        pod = deployment(name.removeprefix("speclane-"))["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), name
        named_ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert named_ports[port["targetPort"]] == port["port"], (name, port)


def test_gateway_peers_are_services_that_exist():
    env = environment(main_container("gateway"))
    services = {name: {p["port"] for p in s["spec"]["ports"]} for name, s in by_kind("Service").items()}
    peers = [env["SPECLANE_GATEWAY_DRAFTER_ADDRESS"], *env["SPECLANE_GATEWAY_VERIFIER_ADDRESSES"].split(",")]
    for address in peers:
        host, _, port = address.removeprefix(DNS_SCHEME).rpartition(":")
        assert host in services and int(port) in services[host], address


def test_the_router_finds_the_gateway_pods_by_their_label_and_http_port():
    args = main_container("router")["args"]
    option = lambda name: args[args.index(name) + 1]  # noqa: E731
    gateway = deployment("gateway")["spec"]["template"]
    key, _, value = option("--selector").partition("=")
    assert gateway["metadata"]["labels"][key] == value
    http = {p["name"]: p["containerPort"] for p in main_container("gateway")["ports"]}["http"]
    assert int(option("--service-discovery-port")) == http
    assert "--service-discovery" in args and option("--policy") == "cache_aware"
    # Discovery lists and watches pods: the router's service account may, and nothing more.
    assert pod_spec("router")["serviceAccountName"] == "speclane-router"
    (rule,) = by_kind("Role")["speclane-router"]["rules"]
    assert rule["resources"] == ["pods"] and set(rule["verbs"]) == {"get", "list", "watch"}
    binding = by_kind("RoleBinding")["speclane-router"]
    assert binding["roleRef"]["name"] == "speclane-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "speclane-router"}]


def test_the_router_is_probed_on_its_own_health_and_runs_as_non_root():
    container = main_container("router")
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert "startupProbe" in container
    assert pod_spec("router")["securityContext"]["runAsNonRoot"] is True
    assert container["image"] == main_container("gateway")["image"]


def test_the_gateway_autoscaler_owns_the_replica_count_on_cpu_it_requests():
    autoscaler = by_kind("HorizontalPodAutoscaler")["speclane-gateway"]["spec"]
    assert autoscaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "speclane-gateway"}
    assert "replicas" not in deployment("gateway")["spec"]  # kubectl apply would reset the autoscaler's count
    (metric,) = autoscaler["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert "cpu" in main_container("gateway")["resources"]["requests"]  # utilization is of the request
    assert autoscaler["minReplicas"] >= 2


def test_the_gateways_find_every_verifier_pod_through_a_headless_service():
    (address,) = environment(main_container("gateway"))["SPECLANE_GATEWAY_VERIFIER_ADDRESSES"].split(",")
    assert address.startswith(DNS_SCHEME)
    host = address.removeprefix(DNS_SCHEME).rpartition(":")[0]
    # Headless: the name resolves to each pod, not to one virtual IP in front of them all.
    assert by_kind("Service")[host]["spec"]["clusterIP"] == "None"
    assert host == "speclane-verifier"
    # Several verifier pods, on several nodes, read the one model volume.
    assert by_kind("PersistentVolumeClaim")["speclane-models"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_verifier_autoscaler_scales_on_the_gauges_each_verifier_exports():
    from verifier_service.metrics import VerifierMetrics

    autoscaler = by_kind("HorizontalPodAutoscaler")["speclane-verifier"]["spec"]
    assert autoscaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": "speclane-verifier"}
    assert "replicas" not in deployment("verifier")["spec"]  # kubectl apply would reset the autoscaler's count
    assert 1 <= autoscaler["minReplicas"] < autoscaler["maxReplicas"]
    scaled_on = {metric["pods"]["metric"]["name"] for metric in autoscaler["metrics"] if metric["type"] == "Pods"}
    assert scaled_on == {"vllm_num_requests_waiting", "vllm_kv_cache_usage_perc"}
    # The adapter's rules expose exactly those names, from series the verifier exports...
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    exposed = {}
    for rule in rules:
        series = rule["seriesQuery"].partition("{")[0]
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        exposed[name] = series
    assert set(exposed) == scaled_on
    exported = {metric.name for metric in VerifierMetrics("m").registry.collect()}
    assert set(exposed.values()) <= exported
    # ...on the port the pod serves them on and Prometheus is told to scrape.
    pod = deployment("verifier")["spec"]["template"]
    port = environment(main_container("verifier"))["SPECLANE_VERIFIER_METRICS_PORT"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == port
    assert {"name": "metrics", "containerPort": int(port)} in main_container("verifier")["ports"]
