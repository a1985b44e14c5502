"""tools/probes stay runnable: each imports without running its measurement (its work is in main(),
behind ``if __name__ == "__main__"``), and every project module and name it imports, at the top or
inside main(), still exists (a re-cut of the packages breaks a probe's import first)."""
import ast
import contextlib
import importlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "tools" / "probes"
PROJECT = {"core", "family", "kernels", "kvstore", "scheduler", "worker", "gateway", "engine", "service", "training",
           "evaluation", "benches", "mfs"}
LIBRARIES = {"decode_bound"}  # shared set-up other probes import: no main()


def probe_files() -> list[Path]:
    return sorted(PROBES.glob("*.py"))


def project_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import of a project module in the file (name None: ``import module``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] in PROJECT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PROJECT | LIBRARIES:
                out += [(node.module, a.name) for a in node.names]
    return out


def test_every_probe_is_checked():
    names = {p.stem for p in probe_files()}
    assert {"w4a8_hot", "decode_bound", "ratio_bound", "ppl"} <= names


@pytest.fixture(scope="module")
def probes_on_path():
    sys.path.insert(0, str(PROBES))  # as `python tools/probes/X.py` has it: probes import decode_bound
    yield
    sys.path.remove(str(PROBES))


@pytest.mark.parametrize("path", probe_files(), ids=lambda p: p.name)
def test_a_probe_imports_without_running_and_its_imports_exist(path, probes_on_path):
    spec = importlib.util.spec_from_file_location(f"probe_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(path)]  # a probe run without arguments prints its usage: importing must not
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            spec.loader.exec_module(mod)
    finally:
        sys.argv = argv
    assert out.getvalue() == "", f"importing {path.name} printed: {out.getvalue()[:300]}"
    if path.stem not in LIBRARIES:
        assert callable(getattr(mod, "main", None)), f"{path.name}: its measurement belongs in main()"
        assert 'if __name__ == "__main__":' in path.read_text()
    for module, name in project_imports(path):
        m = importlib.import_module(module)
        if name is not None:
            assert hasattr(m, name) or importlib.util.find_spec(f"{module}.{name}") is not None, \
                f"{path.name}: {module} has no {name}"
