"""No Docker engine runs here, so check what compose.yaml and the Dockerfile name actually exist."""
import importlib.util
import tomllib
from pathlib import Path

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
