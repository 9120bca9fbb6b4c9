"""deploy/ checked without Docker or Kubernetes: by third-party validators, and against the code.

Nothing here starts a container (neither is available where the suite runs).
The files are checked by the tools that define them: the Compose
Specification's schema (check-jsonschema), kustomize's own build of each
Kubernetes variant (kubectl's kustomize) and the Kubernetes API's schemas of
what it renders (kubernetes-validate), promtool for Prometheus. Then each
check ties a value in a deployment file to the code or to another file:
images, ports, commands (parsed by the real CLI), mounted paths, the
configuration (validated by the real ``nemesis validate``), label selectors,
probes (routes of the real admin app), and Prometheus/Grafana wiring.

There are two variants, each a fleet of replicas that share their state: YDB
(``compose.yaml``, ``kubernetes/ydb``), and Kafka with PostgreSQL
(``compose.kafka.yaml``, ``kubernetes/kafka``).
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from nemesis.admin import create_admin_app
from nemesis.cli import build_parser
from nemesis.config.loader import parse_file, validate_paths
from nemesis.config.models import AdminConfig, NemesisConfig
from nemesis.pipeline import PipelineChecker
from nemesis.runtime.app import Proxy
from nemesis.testing.handler import _parse_args as handler_args
from tests.conftest import REPO
from tests.operability import DEPLOY, run_promtool

CONFIG_MOUNT = "/etc/nemesis/config/nemesis.yaml"
# What the Secret nemesis-secrets holds, as a cluster would have it.
SECRETS = {
    "admin-token": "a-token-long-enough-for-the-check",
    "metrics-token": "a-metrics-token-long-enough-for-it",
    "session-secret": "a-session-secret-long-enough-for-the-check-0123",
    "db-dsn": "postgresql://nemesis:pw@db.example.com:5432/nemesis",
}


@dataclass(frozen=True)
class Variant:
    """One way to deploy: its compose file, configuration and Kubernetes overlay."""

    backend: str  # the backend kind, and the name of the overlay
    compose_file: str
    # The compose services the fleet needs besides its own (the broker, the stores).
    infrastructure: frozenset[str]

    @property
    def config_file(self) -> str:
        return f"config/nemesis.{self.backend}.yaml"


VARIANTS = [
    Variant("ydb", "compose.yaml", frozenset({"ydb"})),
    Variant("kafka", "compose.kafka.yaml", frozenset({"kafka", "postgres"})),
]


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def tool(name: str) -> str:
    """A validator the dev extra installs, beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return found


def kustomize(directory: Path) -> str:
    """kustomize's build of ``directory``: what ``kubectl apply -k`` sends."""
    if kubectl := shutil.which("kubectl"):
        command = [kubectl, "kustomize", str(directory)]
    elif standalone := shutil.which("kustomize"):
        command = [standalone, "build", str(directory)]
    else:
        pytest.fail(
            "kustomize is missing: install kubectl (it has kustomize built in) or kustomize"
        )
    built = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert built.returncode == 0, built.stderr
    return built.stdout


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's environment with ``${VAR:-default}`` as compose expands it here."""
    return {
        name: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))
        for name, value in service["environment"].items()
    }


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment, the Secret's keys filled in as a cluster would."""
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "nemesis-secrets", entry
            env[entry["name"]] = SECRETS[ref["key"]]
    return env


@pytest.fixture(scope="module", params=VARIANTS, ids=[v.backend for v in VARIANTS])
def variant(request: pytest.FixtureRequest) -> Variant:
    chosen: Variant = request.param
    return chosen


@pytest.fixture(scope="module")
def compose(variant: Variant) -> dict[str, Any]:
    document: dict[str, Any] = load(DEPLOY / variant.compose_file)
    return document


@pytest.fixture(scope="module")
def config(variant: Variant, compose: dict[str, Any]) -> NemesisConfig:
    env = compose_env(compose["services"]["nemesis"])
    parsed = parse_file(DEPLOY / variant.config_file, NemesisConfig, env=env)
    assert parsed.value is not None, parsed.problems
    return parsed.value


@pytest.fixture(scope="module")
def rendered(variant: Variant) -> str:
    return kustomize(DEPLOY / "kubernetes" / variant.backend)


@pytest.fixture(scope="module")
def manifests(rendered: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered) if d]


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def configmap(manifests: list[dict[str, Any]], name: str) -> dict[str, str]:
    [found] = [m for m in of_kind(manifests, "ConfigMap") if m["metadata"]["name"] == name]
    data: dict[str, str] = found["data"]
    return data


def the_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    [deployment] = of_kind(manifests, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def admin_routes() -> set[str]:
    app = create_admin_app(Proxy(broker=None, integrations={}))  # type: ignore[arg-type]
    return set(app.openapi()["paths"])


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of a compose service's bind mounts and volumes."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        found[target] = source
    return found


def cli_accepts(command: list[str]) -> None:
    assert command[0] == "nemesis", command
    build_parser().parse_args(command[1:])


def nemesis_validate(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real ``nemesis validate`` on ``path``, with only ``env`` (and PATH) set."""
    return subprocess.run(
        [sys.executable, "-m", "nemesis", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", **env},
        cwd=path.parent,
    )


# --- third-party validators --------------------------------------------------------


@pytest.mark.parametrize("variant_file", [v.compose_file for v in VARIANTS])
def test_the_compose_files_follow_the_compose_specification(
    tmp_path: Path, variant_file: str
) -> None:
    checker = [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec"]
    path = DEPLOY / variant_file
    checked = subprocess.run([*checker, str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The validator does refuse what the specification does not allow.
    document = load(path)
    document["services"]["nemesis"]["deploy"]["replica"] = 2
    broken = tmp_path / variant_file
    broken.write_text(yaml.safe_dump(document))
    refused = subprocess.run([*checker, str(broken)], capture_output=True, text=True, check=False)
    assert refused.returncode == 1
    assert "$.services.nemesis.deploy: 'replica'" in refused.stdout


def test_the_kubernetes_variants_pass_the_api_schemas(
    tmp_path: Path, variant: Variant, rendered: str, manifests: list[dict[str, Any]]
) -> None:
    path = tmp_path / f"{variant.backend}.yaml"
    path.write_text(rendered)
    validator = [tool("kubernetes-validate"), "--strict", "--quiet"]
    checked = subprocess.run([*validator, str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Every kind but the operator's ServiceMonitor has a schema there (that one is
    # checked against its Service below).
    unchecked = re.findall(r"Couldn't find schema for kind (\w+)", checked.stdout + checked.stderr)
    assert unchecked == ["ServiceMonitor"]
    # The validator does refuse a field the API does not have.
    broken = copy.deepcopy(manifests)
    [deployment] = of_kind(broken, "Deployment")
    deployment["spec"]["replica"] = 2
    path.write_text(yaml.safe_dump_all(broken))
    refused = subprocess.run([*validator, str(path)], capture_output=True, text=True, check=False)
    assert refused.returncode != 0
    assert "replica" in refused.stdout + refused.stderr


def test_prometheus_configuration_passes_promtool(tmp_path: Path) -> None:
    settings = load(DEPLOY / "prometheus/prometheus.yml")
    # As mounted in compose: the rule file beside it.
    settings["rule_files"] = [str(DEPLOY / "prometheus/alerts.yaml")]
    # And the metrics token's file, which compose's entrypoint writes before Prometheus starts.
    token_file = tmp_path / "metrics-token"
    token_file.write_text("a-metrics-token-long-enough-for-it")
    for job in settings["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token_file)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(settings))
    checked = run_promtool("check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- the fleet: every replica meets the others in one state store -----------------------


def test_validate_accepts_each_shipped_configuration_and_refuses_the_old_shape(
    tmp_path: Path, variant: Variant, compose: dict[str, Any], manifests: list[dict[str, Any]]
) -> None:
    shipped = configmap(manifests, "nemesis-config")["nemesis.yaml"]
    env = pod_env(the_container(manifests))
    pod = tmp_path / "pod" / "nemesis.yaml"
    pod.parent.mkdir()
    pod.write_text(shipped)
    # The pod's environment sets every variable the file reads without a default.
    for path, env_of in (
        (pod, env),
        (DEPLOY / variant.config_file, compose_env(compose["services"]["nemesis"])),
    ):
        result = nemesis_validate(path, env_of)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "all valid" in result.stdout
        assert "warning" not in result.stdout + result.stderr
    # Without its shared stores, as the manifests once were: each pod alone.
    document = yaml.safe_load(shipped)
    del document["state"]
    if variant.backend == "kafka":
        del document["dlq"]
    old = tmp_path / "old" / "nemesis.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(document))
    result = nemesis_validate(old, env)
    assert result.returncode == 1
    assert "nemesis.yaml:1: state: the sqlite state store (the default)" in result.stdout
    assert f"the {variant.backend} backend shares its topics" in result.stdout


def test_the_replicas_share_their_state_and_dlq(config: NemesisConfig, variant: Variant) -> None:
    assert config.backend.kind == variant.backend
    assert config.single_host is False
    assert not config.state.per_host
    assert not config.dlq.per_host
    if variant.backend == "kafka":
        # One database for both, as docs/state-store.md advises.
        assert (config.state.kind, config.dlq.kind) == ("postgres", "postgres")
        assert config.state.location("").split()[0] == config.dlq.location("").split()[0]


def test_every_replica_has_an_identity_of_its_own(
    compose: dict[str, Any], manifests: list[dict[str, Any]]
) -> None:
    # A member id starts with the host name: a pod's is its name, a container's its id.
    # A fixed name would give every replica the same one.
    nemesis = compose["services"]["nemesis"]
    assert nemesis["deploy"]["replicas"] >= 2
    assert "hostname" not in nemesis
    assert "container_name" not in nemesis
    [deployment] = of_kind(manifests, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] >= 2
    assert not pod.get("hostNetwork", False)
    assert "hostname" not in pod
    assert "setHostnameAsFQDN" not in pod


# --- the process configuration ------------------------------------------------------


def test_the_deployed_configuration_validates_and_matches_the_configmap(
    config: NemesisConfig, variant: Variant, manifests: list[dict[str, Any]]
) -> None:
    assert config.backend.kind == variant.backend
    assert (config.admin.host, config.viewer.host) == ("0.0.0.0", "0.0.0.0")
    assert config.admin.port == AdminConfig().port  # the code's default, which the image uses
    assert config.admin.token is not None
    # A viewer session signed on one replica is good on the others.
    assert config.auth.session_secret is not None
    shipped = configmap(manifests, "nemesis-config")["nemesis.yaml"]
    assert yaml.safe_load(shipped) == load(DEPLOY / variant.config_file)


def test_the_deployed_integrations_validate(
    tmp_path: Path, manifests: list[dict[str, Any]]
) -> None:
    compose_problems = validate_paths(
        [DEPLOY / "config" / "integrations", REPO / "pipelines"],
        env={},
        checkers=[PipelineChecker(pipelines_dirs=[REPO / "pipelines"])],
    )
    assert compose_problems == []
    # The ConfigMaps' files, as the pod sees them.
    env = pod_env(the_container(manifests))
    maps = {m["metadata"]["name"]: m["data"] for m in of_kind(manifests, "ConfigMap")}
    for name, folder in (
        ("nemesis-integrations", "integrations"),
        ("nemesis-pipelines", "pipelines"),
    ):
        (tmp_path / folder).mkdir()
        for file, text in maps[name].items():
            (tmp_path / folder / file).write_text(text)
    problems = validate_paths(
        [tmp_path / "integrations", tmp_path / "pipelines"],
        env=env,
        checkers=[PipelineChecker(pipelines_dirs=[tmp_path / "pipelines"])],
    )
    assert problems == []


# --- compose ----------------------------------------------------------------------


def test_compose_runs_the_broker_its_stores_and_a_fleet_on_them(
    compose: dict[str, Any], config: NemesisConfig, variant: Variant
) -> None:
    services = compose["services"]
    assert set(services) == {
        *variant.infrastructure,
        "init",
        "nemesis",
        "handler",
        "producer",
        "prometheus",
        "grafana",
    }
    for name, service in services.items():
        assert service.get("image"), f"{name} has no image"
    nemesis = services["nemesis"]
    env = compose_env(nemesis)
    assert "NEMESIS_ADMIN_TOKEN" in env
    # A host port per replica, each to the port the configuration listens on.
    replicas = nemesis["deploy"]["replicas"]
    for port in (config.admin.port, config.viewer.port):
        [mapping] = [p for p in nemesis["ports"] if p.endswith(f":{port}")]
        first, last = (int(n) for n in mapping.rsplit(":", 1)[0].split("-"))
        assert last - first + 1 == replicas, mapping
    for name in variant.infrastructure:
        assert nemesis["depends_on"][name]["condition"] == "service_healthy"
        assert services[name]["healthcheck"]["test"]
    assert nemesis["depends_on"]["init"]["condition"] == "service_completed_successfully"
    if variant.backend == "ydb":
        ydb = services["ydb"]
        assert ydb["image"].startswith("ydbplatform/local-ydb:")
        grpc, ui = ydb["environment"]["GRPC_PORT"], ydb["environment"]["MON_PORT"]
        assert (grpc, ui) == ("2136", "8765")
        assert {f"{grpc}:{grpc}", f"{ui}:{ui}"} <= set(ydb["ports"])
        assert "/local" in ydb["healthcheck"]["test"]
        # The endpoint names the YDB service by the host name it advertises.
        assert env["NEMESIS_YDB_ENDPOINT"] == f"grpc://{ydb['hostname']}:{grpc}"
        assert env["NEMESIS_YDB_DATABASE"] == "/local"
    else:
        kafka, postgres = services["kafka"], services["postgres"]
        assert kafka["image"].startswith("apache/kafka:")
        # Clients are sent to the advertised listener: it must be the compose host name.
        advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
        assert advertised == f"PLAINTEXT://{env['NEMESIS_KAFKA_BOOTSTRAP']}"
        assert env["NEMESIS_KAFKA_BOOTSTRAP"].split(":")[0] == kafka["hostname"]
        # One broker: the topics Nemesis creates cannot have more copies.
        assert env["NEMESIS_KAFKA_REPLICATION_FACTOR"] == "1"
        assert kafka["environment"]["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
        assert postgres["image"].startswith("postgres:")
        dsn = urlsplit(env["NEMESIS_DB_DSN"])
        database = compose_env(postgres)
        assert (dsn.hostname, dsn.port) == ("postgres", 5432)
        assert dsn.username == database["POSTGRES_USER"]
        assert dsn.password == database["POSTGRES_PASSWORD"]
        assert dsn.path == f"/{database['POSTGRES_DB']}"
        assert database["POSTGRES_USER"] in postgres["healthcheck"]["test"]


def test_compose_commands_and_mounts_agree_with_the_cli_and_the_config(
    compose: dict[str, Any], config: NemesisConfig, variant: Variant
) -> None:
    services = compose["services"]
    for name in ("init", "nemesis"):
        command = services[name]["command"]
        cli_accepts(command)
        assert command[command.index("-c") + 1] == CONFIG_MOUNT
    publish = shlex.split(services["producer"]["command"][0].replace("$$", "$"))
    at = publish.index("nemesis")
    cli_accepts(publish[at : publish.index(">/dev/null;")])
    for name in ("init", "nemesis", "producer"):
        found = mounts(services[name])
        assert found[CONFIG_MOUNT] == f"./{variant.config_file}"
        assert found[config.integrations_dir] == "./config/integrations"
        assert found[config.pipelines_dir] == "../pipelines"
        for target, source in found.items():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} -> {target}"
    # Nothing of the fleet's is kept in data_dir: both stores are shared.
    assert config.data_dir not in mounts(services["nemesis"])
    for name in ("init", "handler", "producer"):
        # The image's health check asks the admin port, which only `nemesis run` serves.
        assert services[name]["healthcheck"] == {"disable": True}


def test_the_example_handler_is_where_the_integration_delivers(compose: dict[str, Any]) -> None:
    handler = compose["services"]["handler"]
    command = handler["command"]
    assert command[:3] == ["python", "-m", "nemesis.testing.handler"]
    args = handler_args(command[3:])
    assert (args.host, args.port) == ("0.0.0.0", 9001)
    assert f"{args.port}:{args.port}" in handler["ports"]
    integration = load(DEPLOY / "config/integrations/orders-to-example.yaml")
    assert integration["target"]["url"].startswith(f"http://handler:{args.port}/")
    assert compose["services"]["nemesis"]["depends_on"]["handler"]


def test_prometheus_scrapes_the_admin_port_and_loads_the_alerts(
    compose: dict[str, Any], config: NemesisConfig
) -> None:
    prometheus = compose["services"]["prometheus"]
    found = mounts(prometheus)
    settings = load(DEPLOY / found["/etc/prometheus/prometheus.yml"])
    assert found["/etc/prometheus/alerts.yaml"] == "./prometheus/alerts.yaml"
    assert settings["rule_files"] == ["/etc/prometheus/alerts.yaml"]
    [job] = settings["scrape_configs"]
    assert job["job_name"] == "nemesis"  # NemesisDown looks for up{job="nemesis"}
    assert job["metrics_path"] == "/metrics"
    assert "/metrics" in admin_routes()
    # Every replica, each an instance: the service name resolves to all of them.
    [discovery] = job["dns_sd_configs"]
    assert discovery["names"] == ["nemesis"]
    assert (discovery["type"], discovery["port"]) == ("A", config.admin.port)
    assert "nemesis" in compose["services"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    # /metrics takes admin.metrics_token: Prometheus sends the replicas' own variable.
    assert job["authorization"]["type"] == "Bearer"
    token_file = job["authorization"]["credentials_file"]
    script = " ".join(prometheus["entrypoint"])
    assert f'"$$NEMESIS_METRICS_TOKEN" > {token_file}' in script
    nemesis_env = compose["services"]["nemesis"]["environment"]
    assert (
        prometheus["environment"]["NEMESIS_METRICS_TOKEN"] == nemesis_env["NEMESIS_METRICS_TOKEN"]
    )
    assert config.admin.metrics_token is not None


def test_grafana_provisions_the_datasource_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    found = mounts(grafana)
    provisioning = DEPLOY / found["/etc/grafana/provisioning"]
    [datasource] = load(provisioning / "datasources/prometheus.yaml")["datasources"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    [provider] = load(provisioning / "dashboards/nemesis.yaml")["providers"]
    dashboards_target = provider["options"]["path"]
    dashboards = DEPLOY / found[dashboards_target]
    assert (dashboards / "nemesis.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_target}/nemesis.json"


# --- the image ----------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_the_image_is_slim_non_root_and_checks_the_admin_port(compose: dict[str, Any]) -> None:
    instructions = dockerfile()
    bases = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert all(re.match(r"python:\$\{PYTHON_VERSION\}-slim( AS \w+)?$", base) for base in bases)
    [user] = [rest for keyword, rest in instructions if keyword == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit()
    assert int(uid) > 0
    [exposed] = [rest.split() for keyword, rest in instructions if keyword == "EXPOSE"]
    assert {str(AdminConfig().port), "8080"} <= set(exposed)
    [check] = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    assert "/healthz" in check
    assert "/healthz" in admin_routes()
    assert f"'NEMESIS_ADMIN_PORT', '{AdminConfig().port}'" in check
    # The image's environment is deploy/install.sh's (tests/test_install.py runs it).
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    assert any("deploy/install.sh" in run for run in runs)
    [cmd] = [rest for keyword, rest in instructions if keyword == "CMD"]
    command = yaml.safe_load(cmd)
    cli_accepts(command)
    assert command == compose["services"]["nemesis"]["command"]
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for keyword, rest in instructions:
        if keyword == "COPY" and "--from" not in rest:
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), source
                assert f"!{source}" in ignore or f"!{source}/**" in ignore, source
    images = {service["image"] for service in compose["services"].values()}
    assert "nemesis:local" in images


# --- Kubernetes ---------------------------------------------------------------------


def test_each_kustomization_lists_every_manifest_of_its_folder() -> None:
    root = DEPLOY / "kubernetes"
    base = load(root / "base/kustomization.yaml")
    files = {p.name for p in (root / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(base["resources"]) == files
    for variant in VARIANTS:
        overlay = load(root / variant.backend / "kustomization.yaml")
        assert overlay["namespace"] == "nemesis"
        listed = {*overlay["resources"], *(patch["path"] for patch in overlay["patches"])}
        files = {p.name for p in (root / variant.backend).glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == {"../base", *files}


def test_the_deployment_probes_ports_and_mounts(
    manifests: list[dict[str, Any]], config: NemesisConfig, variant: Variant
) -> None:
    [deployment] = of_kind(manifests, "Deployment")
    spec = deployment["spec"]
    template = spec["template"]
    labels = template["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["replicas"] >= 2
    pod = template["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_grace_s
    assert pod["securityContext"]["runAsNonRoot"] is True
    user = next(rest for keyword, rest in dockerfile() if keyword == "USER").split(":")[0]
    assert str(pod["securityContext"]["runAsUser"]) == user
    [container] = pod["containers"]
    assert container["image"].rsplit(":", 1)[0].endswith("/nemesis")
    cli_accepts(container["args"])
    assert container["args"][container["args"].index("-c") + 1] == CONFIG_MOUNT
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"admin": config.admin.port, "viewer": config.viewer.port}
    routes = admin_routes()
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "admin"}
        assert path in routes
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["limits"]["memory"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e for e in container["env"]}
    # Secrets come from the Secret, never a value in the manifest.
    secrets = {"NEMESIS_ADMIN_TOKEN", "NEMESIS_METRICS_TOKEN", "NEMESIS_SESSION_SECRET"}
    if variant.backend == "kafka":
        secrets.add("NEMESIS_DB_DSN")
    for name in secrets:
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "nemesis-secrets", name
    assert env["NEMESIS_ADMIN_PORT"]["value"] == str(config.admin.port)
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.admin.port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # Every mount has a volume; the config's directories are mounted; the writable ones
    # (data_dir, /tmp) are emptyDirs under the read-only root.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    configmaps = {m["metadata"]["name"] for m in of_kind(manifests, "ConfigMap")}
    assert mounted[str(Path(CONFIG_MOUNT).parent)]["configMap"]["name"] == "nemesis-config"
    assert mounted[config.integrations_dir]["configMap"]["name"] in configmaps
    assert mounted[config.pipelines_dir]["configMap"]["name"] in configmaps
    assert "emptyDir" in mounted[config.data_dir]
    assert "emptyDir" in mounted["/tmp"]


def test_services_pdb_and_servicemonitor_select_the_pods(
    manifests: list[dict[str, Any]], config: NemesisConfig
) -> None:
    [deployment] = of_kind(manifests, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container_ports = {
        p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    assert set(services) == {"nemesis", "nemesis-pods"}
    for service in services.values():
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports
    assert services["nemesis-pods"]["spec"]["clusterIP"] == "None"
    [pdb] = of_kind(manifests, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    [monitor] = of_kind(manifests, "ServiceMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in services.values() if wanted.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["nemesis"]  # each pod scraped once
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    # The scrape sends admin.metrics_token, from the Secret the pods read it from.
    credentials = endpoint["authorization"]["credentials"]
    assert (credentials["name"], credentials["key"]) == ("nemesis-secrets", "metrics-token")
    env = pod_env(the_container(manifests))
    assert env["NEMESIS_METRICS_TOKEN"] == SECRETS["metrics-token"]
    assert services["nemesis"]["spec"]["ports"][0]["port"] == config.admin.port


def test_the_readme_says_the_deployment_is_checked_not_started() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert "**Checked, not started.**" in readme
    for path in (
        "compose.yaml",
        "compose.kafka.yaml",
        "kubernetes/base/",
        "kubernetes/ydb/",
        "kubernetes/kafka/",
        "prometheus/alerts.yaml",
        "grafana/dashboards/nemesis.json",
    ):
        assert path in readme


def test_the_deploy_readme_lists_every_shipped_alert() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    readme = (DEPLOY / "README.md").read_text()
    assert {alert for alert in alerts if f"`{alert}`" not in readme} == set()


# Alertmanager's configuration keys (prometheus/alertmanager config/config.go), enough
# for what the example uses: an unknown key there is refused by Alertmanager itself.
_ROUTE_KEYS = {"receiver", "group_by", "group_wait", "group_interval", "repeat_interval"}
_ROUTE_KEYS |= {"matchers", "routes", "continue"}
_MATCHER = re.compile(r'(\w+)(=|!=|=~|!~)"([^"]*)"')


def test_the_alertmanager_example_routes_each_owner_team_to_its_receiver() -> None:
    path = DEPLOY / "prometheus/alertmanager.yaml"
    amtool = shutil.which("amtool")
    if amtool is not None:  # Debian's prometheus-alertmanager ships it
        checked = subprocess.run(
            [amtool, "check-config", str(path)], capture_output=True, text=True, check=False
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    settings = load(path)
    assert set(settings) <= {"global", "route", "receivers", "inhibit_rules", "templates"}
    receivers = {receiver["name"] for receiver in settings["receivers"]}
    assert len(receivers) == len(settings["receivers"])
    route = settings["route"]
    assert set(route) <= _ROUTE_KEYS
    assert route["receiver"] in receivers  # alerts with no team, or team="unknown"
    routed: dict[str, str] = {}
    for child in route["routes"]:
        assert set(child) <= _ROUTE_KEYS, child
        matchers = [_MATCHER.fullmatch(matcher) for matcher in child["matchers"]]
        assert all(matchers), child["matchers"]
        [(label, op, team)] = [m.groups() for m in matchers if m is not None]
        assert (label, op) == ("team", "=")
        assert child["receiver"] in receivers
        routed[team] = child["receiver"]
    # Every owner of the shipped integrations has its route.
    owners = {
        owner
        for folder in (REPO / "integrations", DEPLOY / "config" / "integrations")
        for file in folder.glob("*.yaml")
        for owner in load(file)["owners"]
    }
    assert owners <= set(routed), owners - set(routed)
    for rule in settings["inhibit_rules"]:
        assert all(_MATCHER.fullmatch(m) for m in rule["source_matchers"] + rule["target_matchers"])
