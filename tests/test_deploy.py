"""deploy/ checked without Docker or Kubernetes: parsed, and consistent with the code.

Nothing here starts a container (neither is available where the suite runs);
each check ties a value in a deployment file to the code or to another file:
images, ports, commands (parsed by the real CLI), mounted paths, the
configuration (validated by the real loader), label selectors, probes
(routes of the real admin app), and Prometheus/Grafana wiring.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

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
from tests.operability import DEPLOY

ENV = {
    "NEMESIS_YDB_ENDPOINT": "grpc://ydb:2136",
    "NEMESIS_YDB_DATABASE": "/local",
    "NEMESIS_ADMIN_TOKEN": "a-token-long-enough-for-the-check",
}
CONFIG_MOUNT = "/etc/nemesis/config/nemesis.yaml"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_all(directory: Path) -> list[dict[str, Any]]:
    documents = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = load(DEPLOY / "compose.yaml")
    return document


@pytest.fixture(scope="module")
def config() -> NemesisConfig:
    parsed = parse_file(DEPLOY / "config" / "nemesis.yaml", NemesisConfig, env=ENV)
    assert parsed.value is not None, parsed.problems
    return parsed.value


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    return load_all(DEPLOY / "kubernetes")


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


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


# --- the process configuration ------------------------------------------------------


def test_the_deployed_configuration_validates_and_matches_the_configmap(
    config: NemesisConfig, manifests: list[dict[str, Any]]
) -> None:
    assert config.backend.kind == "ydb"
    assert (config.admin.host, config.viewer.host) == ("0.0.0.0", "0.0.0.0")
    assert config.admin.port == AdminConfig().port  # the code's default, which the image uses
    assert config.admin.token is not None
    [configmap] = [
        m for m in of_kind(manifests, "ConfigMap") if m["metadata"]["name"] == "nemesis-config"
    ]
    assert yaml.safe_load(configmap["data"]["nemesis.yaml"]) == load(DEPLOY / "config/nemesis.yaml")


def test_the_deployed_integrations_validate(
    tmp_path: Path, manifests: list[dict[str, Any]]
) -> None:
    compose_problems = validate_paths(
        [DEPLOY / "config" / "integrations", REPO / "pipelines"],
        env=ENV,
        checkers=[PipelineChecker(pipelines_dirs=[REPO / "pipelines"])],
    )
    assert compose_problems == []
    # The ConfigMaps' files, as the pod sees them.
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
        env=ENV,
        checkers=[PipelineChecker(pipelines_dirs=[tmp_path / "pipelines"])],
    )
    assert problems == []


# --- compose ----------------------------------------------------------------------


def test_compose_runs_local_ydb_and_nemesis_on_it(
    compose: dict[str, Any], config: NemesisConfig
) -> None:
    services = compose["services"]
    assert set(services) == {
        "ydb",
        "init",
        "nemesis",
        "handler",
        "producer",
        "prometheus",
        "grafana",
    }
    for name, service in services.items():
        assert service.get("image"), f"{name} has no image"
    ydb = services["ydb"]
    assert ydb["image"].startswith("ydbplatform/local-ydb:")
    grpc, ui = ydb["environment"]["GRPC_PORT"], ydb["environment"]["MON_PORT"]
    assert (grpc, ui) == ("2136", "8765")
    assert {f"{grpc}:{grpc}", f"{ui}:{ui}"} <= set(ydb["ports"])
    assert "/local" in ydb["healthcheck"]["test"]
    nemesis = services["nemesis"]
    env = nemesis["environment"]
    # The endpoint names the YDB service by the host name it advertises.
    assert env["NEMESIS_YDB_ENDPOINT"] == f"grpc://{ydb['hostname']}:{grpc}"
    assert env["NEMESIS_YDB_DATABASE"] == "/local"
    assert "NEMESIS_ADMIN_TOKEN" in env
    assert {
        f"{config.admin.port}:{config.admin.port}",
        f"{config.viewer.port}:{config.viewer.port}",
    } <= set(nemesis["ports"])
    assert nemesis["depends_on"]["ydb"]["condition"] == "service_healthy"
    assert nemesis["depends_on"]["init"]["condition"] == "service_completed_successfully"


def test_compose_commands_and_mounts_agree_with_the_cli_and_the_config(
    compose: dict[str, Any], config: NemesisConfig
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
        assert found[CONFIG_MOUNT] == "./config/nemesis.yaml"
        assert found[config.integrations_dir] == "./config/integrations"
        assert found[config.pipelines_dir] == "../pipelines"
        for target, source in found.items():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} -> {target}"
    assert mounts(services["nemesis"])[config.data_dir] == "nemesis-data"
    assert "nemesis-data" in compose["volumes"]
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
    assert job["static_configs"][0]["targets"] == [f"nemesis:{config.admin.port}"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


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


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load(DEPLOY / "kubernetes/kustomization.yaml")
    files = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_the_deployment_probes_ports_and_mounts(
    manifests: list[dict[str, Any]], config: NemesisConfig
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
    assert {"NEMESIS_YDB_ENDPOINT", "NEMESIS_YDB_DATABASE", "NEMESIS_ADMIN_TOKEN"} <= set(env)
    assert env["NEMESIS_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "nemesis-secrets"
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
    assert services["nemesis"]["spec"]["ports"][0]["port"] == config.admin.port


def test_the_readme_says_the_deployment_was_not_run_here() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert "Not run here." in readme
    for path in (
        "compose.yaml",
        "kubernetes/",
        "prometheus/alerts.yaml",
        "grafana/dashboards/nemesis.json",
    ):
        assert path in readme


def test_the_deploy_readme_lists_every_shipped_alert() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    readme = (DEPLOY / "README.md").read_text()
    assert {alert for alert in alerts if f"`{alert}`" not in readme} == set()
