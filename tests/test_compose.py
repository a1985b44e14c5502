"""The fast, static checks of compose.yaml and the Dockerfile (`make compose-test` builds and runs them
for real): `docker compose config` validates, what they name exists, Redis asks for a password that the
MFS services get in REDIS_URL, only the gateway's port is published, and the monitoring profile's
Prometheus config and Grafana dashboard hold (promtool, the gateway's series)."""
import importlib.util
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_and_commands_exist():
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    assert {"redis", "gateway", "scheduler", "worker"} <= set(services)
    for name in ("gateway", "scheduler", "worker"):
        cmd = services[name]["command"]
        text = " ".join(cmd)
        module = text.split("python -m ", 1)[1].split()[0]
        assert module == name
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module} has no __main__"
        assert "--redis-url" not in text  # REDIS_URL, from the environment below
        assert services[name]["environment"]["REDIS_URL"] == REDIS_URL
        for dep in services[name].get("depends_on", {}):
            assert dep in services
    # only the gateway's port is published (monitoring's UIs on the host's loopback alone)
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert published.pop("gateway") == ["${MFS_PORT:-8000}:8000"]
    assert all(p.startswith("127.0.0.1:") for ports in published.values() for p in ports), published
    # a service that dies comes back, as under `mfs up`
    assert all(s.get("restart") == "unless-stopped" for s in services.values()), services


REDIS_URL = ("${MFS_REDIS_SCHEME:-redis}://:${MFS_REDIS_PASSWORD:?set MFS_REDIS_PASSWORD, or run make compose-env "
             "(it writes a random one to .env)}@${MFS_REDIS_HOSTS:-redis:6379/0}")


def test_compose_redis_asks_for_the_password():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name in ("redis", "redis-replica", "sentinel-1"):
        assert services[name]["environment"]["REDISCLI_AUTH"].startswith("${MFS_REDIS_PASSWORD:?")
    assert '--requirepass "$$REDISCLI_AUTH"' in services["redis"]["command"][-1]
    assert '--masterauth "$$REDISCLI_AUTH"' in services["redis-replica"]["command"][-1]
    assert "sentinel auth-pass mfs %s" in services["sentinel-1"]["command"][-1]
    assert ".env" in (ROOT / ".gitignore").read_text().split()


COMPOSE = shutil.which("docker-compose") or shutil.which("docker")


@pytest.mark.skipif(COMPOSE is None, reason="no docker-compose or docker client (`make test` installs "
                    "docker-compose when run as root with apt-get)")
def test_docker_compose_config_validates_with_every_profile():
    cmd = [COMPOSE] if COMPOSE.endswith("docker-compose") else [COMPOSE, "compose"]
    env = {"PATH": "/usr/bin:/bin", "MFS_REDIS_PASSWORD": "0123abcd"}
    profiles = ["--profile", "ha", "--profile", "cuda", "--profile", "monitoring"]  # every service at once
    out = subprocess.run([*cmd, "-f", str(ROOT / "compose.yaml"), *profiles, "config", "-q"], env=env,
                         capture_output=True, text=True, timeout=60)
    if "is not a docker command" in out.stderr:
        pytest.skip("this docker client has no compose")
    assert out.returncode == 0, out.stderr
    unset = subprocess.run([*cmd, "-f", str(ROOT / "compose.yaml"), "config", "-q"], env={"PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=60, cwd="/")
    assert unset.returncode != 0 and "make compose-env" in unset.stderr  # no password: refused, saying how


def test_compose_cuda_profile_reserves_a_gpu_for_a_cuda_worker():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    cuda = services["worker-cuda"]
    assert cuda["profiles"] == ["cuda"] and cuda["build"]["args"]["TORCH_INDEX"] == ""
    assert "--device cuda" in cuda["command"][-1]
    (dev,) = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]


def test_compose_ha_profile_has_a_replica_and_three_sentinels():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    ha = {name for name, s in services.items() if "ha" in s.get("profiles", [])}
    assert ha == {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
    replica = " ".join(services["redis-replica"]["command"])
    assert "--replicaof redis 6379" in replica
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        s = services[name]
        cmd = " ".join(s["command"])
        assert "--sentinel" in cmd and "sentinel monitor mfs redis 6379 2" in cmd and s["hostname"] == name
        assert s["restart"] == "unless-stopped"
    # the sentinel URL the compose file tells users to set names exactly these sentinels and master
    from core.redisconn import RedisTarget
    head = (ROOT / "compose.yaml").read_text().split("services:")[0]
    said = dict(w.split("=", 1) for w in head.split() if w.startswith(("MFS_REDIS_SCHEME=", "MFS_REDIS_HOSTS=")))
    t = RedisTarget.parse(f"{said['MFS_REDIS_SCHEME']}://:pw@{said['MFS_REDIS_HOSTS']}")
    assert t.master == "mfs" and {h for h, _ in t.sentinels} == {"sentinel-1", "sentinel-2", "sentinel-3"}


def test_dockerfile_copies_every_package_it_runs():
    text = (ROOT / "Dockerfile").read_text()
    # every package pyproject installs (a new one must be copied too)
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    pkgs = [p.rstrip("*") for p in include]
    assert "core" in pkgs and "scheduler" in pkgs
    for pkg in pkgs:
        assert f"COPY {pkg} {pkg}" in text
        assert (ROOT / pkg / "__init__.py").exists()
    assert "make setup" in text and "LOCK=requirements.lock" in text  # the serving packages, not the tests'
    ignored = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    copied = {w for line in text.splitlines() if line.startswith("COPY ") for w in line.split()[1:-1]}
    assert ignored[0] == "*" and all(f"!{c}" in ignored for c in copied)  # the context holds what is copied
    # every library of our CPU operators is built into the image (a worker on this CPU kind builds none)
    libs = sorted(f.stem for f in (ROOT / "kernels").glob("cpu_*.py") if "\nSOURCE = " in f.read_text())
    build = next(line for line in text.split("RUN ") if "m.build()" in line)
    assert libs and all(f"{lib} as" in build for lib in libs), (libs, build)


PROMTOOL = shutil.which("promtool")


def test_compose_monitoring_profile_mounts_what_monitoring_ships():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    mon = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert mon == {"prometheus", "grafana"}
    for name in mon:
        for vol in services[name]["volumes"]:
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name} mounts {src}, which is not in the repository"
    prom = yaml.safe_load((ROOT / "monitoring/prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["dns_sd_configs"][0]["names"] == ["gateway"] and job["dns_sd_configs"][0]["port"] == 8000
    # the gateway service listens where Prometheus looks
    assert "--port" in services["gateway"]["command"] and "8000" in services["gateway"]["command"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package `prometheus`; "
                    "`make test` installs it when run as root with apt-get)")
def test_prometheus_config_passes_promtool():
    out = subprocess.run([PROMTOOL, "check", "config", str(ROOT / "monitoring/prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_dashboard_queries_series_the_gateway_exports():
    """Every mfs_* name in the dashboard's queries is a series some gateway renders (a renamed metric
    would leave a panel empty without an error)."""
    from gateway.metrics import Metrics
    exported = set()
    for line in Metrics().render().decode().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            exported |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
    dash = json.loads((ROOT / "monitoring/grafana/dashboards/mfs.json").read_text())
    ds = yaml.safe_load((ROOT / "monitoring/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    used = set()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == uid
        for target in panel["targets"]:
            used |= set(re.findall(r"\bmfs_[a-z_]+", target["expr"]))
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"] for p in dash["panels"])
    for what in ("running", "Tokens/s", "TTFT", "TPOT", "KV blocks", "hit rate", "Speculation", "Escalations"):
        assert what in titles, what
