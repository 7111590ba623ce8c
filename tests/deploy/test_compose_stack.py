"""The compose stack, checked without a Docker engine: its services, volumes, health checks and
restart policies, that every file it references exists, that each container's command is a
valid ``kvbatch`` command line, and that Prometheus scrapes the port the workers serve."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.api.settings import ApiSettings
from jobs.limits import JobLimits
from worker.cli import build_parser
from worker.control.settings import ControlSettings
from worker.settings import ENGINE_FIELDS, WORKER_FIELDS, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"redis", "postgres", "migrate", "db-roles", "worker", "control", "api",
            "prometheus", "grafana"}
ONE_SHOT = {"migrate", "db-roles"}  # run to completion, then exit
KVBATCH = ("migrate", "worker", "control", "api")
REQUIRED = re.compile(r"\$\{(\w+):\?[^}]+\}")  # ${VAR:?message}: compose refuses to start unset


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(v.split(":")[:2]) for v in service.get("volumes", [])]  # type: ignore[misc]


def test_services_health_checks_and_restart_policies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        if name in ONE_SHOT:  # runs once: retried on failure, never restarted after success
            assert svc["restart"].startswith("on-failure") and "healthcheck" not in svc
            continue
        assert svc["restart"] == "unless-stopped", name
        check = svc["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_redis_persists_never_evicts_and_asks_for_a_password(compose: dict[str, Any]) -> None:
    redis_svc = compose["services"]["redis"]
    command = redis_svc["command"]
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert flags["--requirepass"] == "${REDIS_PASSWORD:?set REDIS_PASSWORD in .env}"
    assert "REDISCLI_AUTH" in redis_svc["healthcheck"]["test"][1]  # the check logs in too
    worker = compose["services"]["worker"]["environment"]
    assert worker["KVBATCH_METRICS_HOST"] == "0.0.0.0"  # 127.0.0.1 outside compose
    assert ("redis-data", "/data") in mounts(compose["services"]["redis"])


def test_kvbatch_services_run_valid_commands_after_migrations(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    for name in KVBATCH:
        svc = services[name]
        assert svc["image"] == services["worker"]["image"]
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        build_parser().parse_args(svc["command"])  # exits on an unknown command or flag
        env = svc["environment"]
        assert env["KVBATCH_DATABASE_URL"].startswith("postgresql://")
        assert env["KVBATCH_DATABASE_URL"].split("@")[1].startswith("postgres:5432/")
        assert env["KVBATCH_REDIS_URL"] == (
            "redis://:${REDIS_PASSWORD:?set REDIS_PASSWORD in .env}@redis:6379/0")
        deps = svc["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy", name
        if name != "migrate":
            assert deps["redis"]["condition"] == "service_healthy", name
            assert deps["migrate"]["condition"] == "service_completed_successfully", name


def test_worker_reserves_a_gpu_caches_models_and_scales(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert ("model-cache", "/cache") in mounts(worker)
    # --scale worker=N: no fixed name, no host port.
    assert "container_name" not in worker and "ports" not in worker
    assert worker["environment"]["KVBATCH_DEVICE"] == "cuda"
    drain_s = WorkerSettings.model_fields["drain_timeout_s"].default
    assert int(worker["stop_grace_period"].rstrip("s")) > drain_s


def test_volumes_declared_and_referenced_files_exist(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    used = set()
    for name, svc in compose["services"].items():
        for source, target in mounts(svc):
            assert target.startswith("/"), name
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} missing"
            else:
                used.add(source)
        for env_file in svc.get("env_file", []):
            if env_file.get("required", True):
                assert (ROOT / env_file["path"]).exists()
    assert used == declared
    assert (ROOT / ".env.example").is_file() and (ROOT / ".dockerignore").is_file()


def test_every_compose_variable_is_documented_in_env_example(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text))  # $${X}: the container's own
    example = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", example, flags=re.M))
    assert used <= documented, sorted(used - documented)
    # Every KVBATCH_* setting in the example is one the worker or control plane reads.
    settings = {"KVBATCH_" + f.upper() for f in
                [*ENGINE_FIELDS, *WORKER_FIELDS, *ControlSettings.model_fields,
                 *JobLimits.model_fields, *("API_" + f for f in ApiSettings.model_fields)]}
    compose_only = {"KVBATCH_IMAGE", "KVBATCH_GPUS_PER_WORKER"}
    kvbatch = {v for v in documented if v.startswith("KVBATCH_")}
    assert kvbatch - compose_only <= settings, sorted(kvbatch - compose_only - settings)
    # Empty numbers would not parse: optional settings are commented out instead.
    assert not re.search(r"^KVBATCH_\w+=\s*$", example, flags=re.M)


def test_dockerfile_builds_a_cuda_torch_image_from_existing_files() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+", dockerfile, flags=re.M)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", dockerfile, flags=re.M)
    # torch pinned, from PyPI unless TORCH_INDEX_URL names another index; a CPU build fails.
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", dockerfile, flags=re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=$", dockerfile, flags=re.M)
    assert ('pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url '
            '"${TORCH_INDEX_URL}"}') in dockerfile
    assert "assert torch.version.cuda" in dockerfile
    for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M):
        for source in line.split()[:-1]:
            assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    copied = {line.split()[0] for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M)}
    assert not copied & set(ignored)
    assert '"kvbatch"]' in dockerfile and "EXPOSE 9400" in dockerfile


def test_published_ports_listen_on_localhost_unless_chosen(compose: dict[str, Any]) -> None:
    """Docker's published ports bypass host firewalls: nothing listens beyond the host by
    default, and no password falls back to a default value."""
    published = {name: svc["ports"] for name, svc in compose["services"].items()
                 if "ports" in svc}
    assert set(published) == {"redis", "postgres", "prometheus", "grafana", "api"}
    for name, ports in published.items():
        for port in ports:
            assert isinstance(port, str) and port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), name
    text = (ROOT / "docker-compose.yml").read_text()
    for secret in ("POSTGRES_PASSWORD", "GRAFANA_DB_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
        uses = re.findall(r"\$\{" + secret + r"\b[^}]*\}", text)
        assert uses and all(REQUIRED.fullmatch(u) for u in uses), (secret, uses)


def test_postgres_health_check_uses_tcp(compose: dict[str, Any]) -> None:
    # During first-start initialization the server listens on its Unix socket only.
    test = compose["services"]["postgres"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and re.search(r"pg_isready -h 127\.0\.0\.1\b", test[1])


def test_reader_role_is_applied_after_every_migration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    roles = services["db-roles"]
    assert roles["image"] == services["postgres"]["image"]
    assert roles["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert roles["depends_on"]["postgres"]["condition"] == "service_healthy"
    sql_dir = {t: s for s, t in mounts(roles)}["/sql"]
    script = next(a for a in roles["command"] if a.startswith("--file=")).split("=", 1)[1]
    assert (ROOT / sql_dir / Path(script).relative_to("/sql")).is_file()
    assert "--set=ON_ERROR_STOP=1" in roles["command"]
    # The script reads the role's name and password from the environment (\getenv).
    sql = (ROOT / sql_dir / Path(script).relative_to("/sql")).read_text()
    for var in re.findall(r"^\\getenv \w+ (\w+)$", sql, flags=re.M):
        assert var in roles["environment"], var
    grafana = services["grafana"]
    assert grafana["depends_on"]["db-roles"]["condition"] == "service_completed_successfully"
    assert (roles["environment"]["GRAFANA_DB_USER"]
            == grafana["environment"]["GRAFANA_DB_USER"])


def test_prometheus_scrapes_every_worker_on_its_metrics_port(compose: dict[str, Any]) -> None:
    services = compose["services"]
    worker = services["worker"]
    port = int(worker["environment"]["KVBATCH_METRICS_PORT"])
    assert str(port) in worker["expose"]
    assert f":{port}/metrics" in " ".join(worker["healthcheck"]["test"])
    prometheus = services["prometheus"]
    host_dir, container_dir = next((s, t) for s, t in mounts(prometheus)
                                   if t == "/etc/prometheus")
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    assert config_path.startswith(container_dir + "/")
    config = yaml.safe_load((ROOT / host_dir / Path(config_path).relative_to(container_dir))
                            .read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "kvbatch-workers")
    dns = job["dns_sd_configs"][0]
    assert dns["names"] == ["worker"] and dns["type"] == "A" and dns["port"] == port
    for sd in job["file_sd_configs"]:  # remote workers: the directory is in the mount
        for pattern in sd["files"]:
            assert (ROOT / host_dir / Path(pattern).relative_to(container_dir).parent).is_dir()


def test_grafana_provisioning_is_mounted_and_complete(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    by_target = {t: s for s, t in mounts(grafana)}
    provisioning = ROOT / by_target["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "kvbatch.yml").read_text())
    # ${VARS} in provisioning files are filled from the grafana container's environment.
    text = (provisioning / "datasources" / "kvbatch.yml").read_text()
    assert set(re.findall(r"\$\{(\w+)\}", text)) <= set(grafana["environment"])
    urls = {d["type"]: d["url"] for d in datasources["datasources"]}
    assert urls["prometheus"] == "http://prometheus:9090"
    assert urls["grafana-postgresql-datasource"] == "postgres:5432"
    provider = yaml.safe_load((provisioning / "dashboards" / "kvbatch.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    dashboards = ROOT / by_target[path]
    assert sorted(p.name for p in dashboards.glob("*.json")) == [
        "kvbatch-jobs.json", "kvbatch-overview.json"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).relative_to(path)).is_file()


class _ComposeLoader(yaml.SafeLoader):
    """Reads Compose's merge tags: ``!override`` replaces instead of merging, ``!reset``
    removes."""


class _Override(list):  # type: ignore[type-arg]
    pass


_ComposeLoader.add_constructor(
    "!override", lambda loader, node: _Override(loader.construct_sequence(node, deep=True)))


def compose_merge(base: Any, override: Any) -> Any:
    """Compose's merge rules for what the docs use: mappings merge key by key, sequences
    append, ``!override`` replaces."""
    if isinstance(override, _Override):
        return list(override)
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: compose_merge(base[k], v) if k in base else v
                for k, v in {**base, **override}.items()}
    if isinstance(base, list) and isinstance(override, list):
        return base + override
    return override


def test_documented_multi_gpu_override_gives_each_worker_one_gpu(
        compose: dict[str, Any]) -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc[doc.index("**One worker per GPU on a multi-GPU host**"):]
    snippet = re.search(r"```yaml\n(.*?)```", section, flags=re.S)
    assert snippet is not None
    override = yaml.load(textwrap.dedent(snippet[1]), Loader=_ComposeLoader)["services"]
    base = compose["services"]["worker"]
    seen = []
    for name, svc in override.items():
        if "extends" in svc:
            assert svc["extends"] == {"file": "docker-compose.yml", "service": "worker"}
            start = base
        else:
            start = compose["services"][name]
        merged = compose_merge(start, {k: v for k, v in svc.items() if k != "extends"})
        devices = merged["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "count" not in devices[0], (name, devices)
        seen += devices[0]["device_ids"]
    assert sorted(seen) == ["0", "1"]
    # Without !override the lists would append: the check above would catch it.
    plain = yaml.safe_load(textwrap.dedent(snippet[1]).replace("!override ", ""))
    merged = compose_merge(base, plain["services"]["worker"])
    assert len(merged["deploy"]["resources"]["reservations"]["devices"]) == 2
