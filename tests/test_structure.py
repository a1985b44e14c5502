"""The shape of the tree: no source file outside tests/ over 450 lines (Python or C++), and no test module
importing another test module (what they share lives in tests/support/)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".c", ".cu"}
SKIP_DIRS = {"tests", ".venv", ".git", "build", "dist", "node_modules", "__pycache__", ".pytest_cache"}


def source_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP_DIRS or any(p in SKIP_DIRS or p.endswith(".egg-info") for p in rel.parts):
            continue
        if path.suffix in SOURCE_SUFFIXES and path.is_file():
            out.append(path)
    return out


def test_the_tree_has_sources_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in source_files()}
    assert {"engine/engine.py", "scheduler/core.py", "kernels/cpu_gemv.py"} <= names


def test_no_source_file_outside_tests_is_over_450_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in source_files()
            if (n := len(p.read_text(errors="replace").splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split them by role): {long}"


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module an import statement in `path` names (``from tests import x`` names tests.x)."""
    package = path.relative_to(root).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            names.add(mod)
            names |= {f"{mod}.{a.name}" for a in node.names}
    return names


def is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts[1:])


def test_no_test_module_imports_another_test_module():
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert any(f.name == "test_engine.py" for f in files)
    bad = {f.relative_to(ROOT).as_posix(): sorted(m for m in imported_modules(f) if is_test_module(m))
           for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"import what is shared from tests/support/ instead: {bad}"


def test_the_import_check_sees_each_form(tmp_path):
    """The check above cannot pass vacuously: each way of importing a test module is caught."""
    (tmp_path / "tests").mkdir()
    f = tmp_path / "tests" / "test_x.py"
    for src in ("from tests.test_engine import x", "from tests import test_engine", "import tests.test_engine",
                "from .test_engine import x", "from . import conftest"):
        f.write_text(src + "\n")
        assert any(is_test_module(m) for m in imported_modules(f, tmp_path)), src
    f.write_text("from tests.support.wait import wait_for\nfrom .support import procs\nimport pytest\n")
    assert not any(is_test_module(m) for m in imported_modules(f, tmp_path))


def test_the_suite_hands_out_its_costliest_files_first(tmp_path):
    """make test runs files on two workers in the order conftest.py gives: the costliest first (a long
    file started last leaves one worker idle), an unknown file as the median; the table is read from a
    JUnit report."""
    from tests.support import costs
    assert costs.order(["a", "b", "c", "new"], {"a": 1.0, "b": 30.0, "c": 5.0}) == ["b", "c", "new", "a"]
    report = tmp_path / "junit.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.test_x" name="t1" time="2.5"/>'
                      '<testcase classname="tests.test_x" name="t2" time="1.0"/>'
                      '<testcase classname="tests.test_y" name="t" time="9"/></testsuite></testsuites>')
    assert costs.from_junit(str(report)) == {"tests/test_y.py": 9.0, "tests/test_x.py": 3.5}
    here = {f"tests/{p.name}" for p in Path(__file__).parent.glob("test_*.py")}
    assert costs.load() and set(costs.load()) <= here  # the shipped table names files that exist
