"""No Docker engine runs here, so check what compose.yaml and the Dockerfile name actually exist, and that
the monitoring profile's Prometheus config and Grafana dashboard hold (promtool, the gateway's series)."""
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
        assert "redis://redis:6379/0" in text
        for dep in services[name].get("depends_on", {}):
            assert dep in services
    assert services["gateway"]["ports"] == ["8000:8000"]
    # the Redis URL may be a Sentinel group's (REDIS_URL, compose interpolation)
    assert all("${REDIS_URL:-redis://redis:6379/0}" in " ".join(services[n]["command"])
               for n in ("gateway", "scheduler", "worker"))
    # a service that dies comes back, as under `mfs up`
    assert all(s.get("restart") == "unless-stopped" for s in services.values()), services


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
    url = next(w for w in head.split() if w.startswith("REDIS_URL=")).split("=", 1)[1]
    t = RedisTarget.parse(url)
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
    assert "make setup" in text


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
