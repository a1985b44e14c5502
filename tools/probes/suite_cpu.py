"""Where the suite's CPU goes. Loaded into pytest, this records every test's CPU in a JSON line: the test
process's own (user + system) and its children's, counted when they are reaped (the services a test
started and stopped, the compiler inductor ran). A module fixture's start counts in its file's first
test, its children in the test whose teardown stops them. Run as a script, it sums the lines by file and
lists the costliest tests; given two files, it sets their per-file sums side by side.

    MFS_SUITE_CPU=/tmp/a.jsonl PYTHONPATH=tools/probes .venv/bin/python -m pytest -p suite_cpu -q -n 3 \\
        --dist loadfile tests
    .venv/bin/python tools/probes/suite_cpu.py /tmp/a.jsonl [/tmp/b.jsonl] [TOP]
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

OUT = os.environ.get("MFS_SUITE_CPU", "suite_cpu.jsonl")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, w0 = os.times(), time.monotonic()
    yield
    t1 = os.times()
    rec = {"id": item.nodeid, "wall": round(time.monotonic() - w0, 3),
           "self": round(t1.user - t0.user + t1.system - t0.system, 3),
           "kids": round(t1.children_user - t0.children_user + t1.children_system - t0.children_system, 3)}
    with open(OUT, "a") as f:  # one short append per test: the xdist workers' lines do not interleave
        f.write(json.dumps(rec) + "\n")


def _load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def by_file(rows: list[dict]) -> dict[str, list[float]]:
    """file -> [own CPU, children's CPU, wall], summed over its tests."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        f = out[r["id"].split("::")[0]]
        f[0] += r["self"]
        f[1] += r["kids"]
        f[2] += r["wall"]
    return dict(out)


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.isdigit()]
    top = int(next((a for a in argv if a.isdigit()), "25"))
    if not 1 <= len(paths) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [_load(p) for p in paths]
    files = [by_file(rows) for rows in runs]
    for p, rows in zip(paths, runs):
        own, kids = sum(r["self"] for r in rows), sum(r["kids"] for r in rows)
        print(f"{p}: {len(rows)} tests, CPU {own + kids:.0f} s (own {own:.0f}, children {kids:.0f})")
    first = files[0]
    names = sorted(first, key=lambda k: -(first[k][0] + first[k][1]))[:top]
    if len(files) == 1:
        print(f"\n{'CPU s':>8} {'own':>7} {'kids':>7} {'wall':>7}  file")
        for k in names:
            own, kids, wall = first[k]
            print(f"{own + kids:8.1f} {own:7.1f} {kids:7.1f} {wall:7.1f}  {k}")
        print(f"\n{'CPU s':>8} {'own':>7} {'kids':>7} {'wall':>7}  test")
        for r in sorted(runs[0], key=lambda r: -(r["self"] + r["kids"]))[:top]:
            print(f"{r['self'] + r['kids']:8.1f} {r['self']:7.1f} {r['kids']:7.1f} {r['wall']:7.1f}  {r['id']}")
    else:
        print(f"\n{'A CPU s':>8} {'B CPU s':>8} {'B/A':>5}  file")
        for k in names:
            a, b = sum(first[k][:2]), sum(files[1].get(k, [0.0, 0.0])[:2])
            print(f"{a:8.1f} {b:8.1f} {b / a if a else 0:5.2f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
