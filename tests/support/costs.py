"""What each test file costs, so that ``make test`` starts the costly ones first.

pytest-xdist's ``--dist loadfile`` hands whole files to its workers in collection order (with
``--no-loadscope-reorder``, set in pyproject.toml; its default orders files by how many tests they hold,
which put the long single-test files, the soak and the fault tests, last, where one worker ran them
while the other sat idle). conftest.py orders the files by the seconds below, most first: the longest
start at once and the short ones fill the end. A file missing from the table counts as the median.

Refresh the table from a full run's JUnit report (the seconds: wall per file in a `make test` run on a 2-vCPU machine)::

    python -m pytest -n 2 --dist loadfile --junitxml=/tmp/junit.xml tests
    python -m tests.support.costs /tmp/junit.xml
"""
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).with_name("file_costs.json")


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def order(files: list[str], costs: dict[str, float]) -> list[str]:
    """The files, costliest first; ties and unknown files keep their order (unknown: the median cost)."""
    default = statistics.median(costs.values()) if costs else 0.0
    return sorted(files, key=lambda f: -costs.get(f, default))


def from_junit(path: str) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests) from a JUnit XML report."""
    out: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        name = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        out[name] = out.get(name, 0.0) + float(case.get("time") or 0.0)
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.costs JUNIT_XML", file=sys.stderr)
        return 2
    costs = from_junit(argv[0])
    if not costs:
        print(f"{argv[0]}: no test cases in it", file=sys.stderr)
        return 1
    TABLE.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"{TABLE}: {len(costs)} files, {sum(costs.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
