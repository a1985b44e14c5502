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
    # a service that dies comes back, as under `mfs up`
    assert all(s.get("restart") == "unless-stopped" for s in services.values()), services


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
