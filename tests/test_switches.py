"""The MFS_* switches (kernels/switches.py): each variable read as documented, a bad value refused
naming it, read once per process and handed to the kernels and the formats from there; no other module
reads them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels import switches
from kernels.switches import OPERATORS, Switches

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env,want", [
    ({}, Switches()),
    ({"MFS_KERNELS": "triton"}, Switches(kernels="triton")),
    ({"MFS_CPU_GEMV": "0", "MFS_CPU_ARGMAX": "1"}, Switches(operators_off=frozenset({"MFS_CPU_GEMV"}))),
    ({"MFS_CPU_ATTENTION": "0", "MFS_CPU_ROWS": "0"},
     Switches(operators_off=frozenset({"MFS_CPU_ATTENTION", "MFS_CPU_ROWS"}))),
    ({"MFS_CPU_GEMV_ISA": "avx2"}, Switches(cpu_gemv_isa="avx2")),
    ({"MFS_NONDETERMINISTIC": "1"}, Switches(nondeterministic=True)),
    ({"MFS_NONDETERMINISTIC": "0", "MFS_W4A8_TILES": "1"}, Switches()),
    ({"MFS_W4A8_TILES": "0", "MFS_QMM_TUNE": "0"}, Switches(w4a8_tiles=False, qmm_tune=False)),
    ({"MFS_KERNELS": "", "MFS_CPU_GEMV": ""}, Switches()),  # set but empty: unset
])
def test_each_variable_reads_as_documented(env, want):
    assert Switches.from_env(env) == want


@pytest.mark.parametrize("name,value", [("MFS_KERNELS", "cuda"), ("MFS_CPU_GEMV", "off"), ("MFS_CPU_ROWS", "no"),
                                        ("MFS_CPU_GEMV_ISA", "avx512"), ("MFS_NONDETERMINISTIC", "yes"),
                                        ("MFS_W4A8_TILES", "2"), ("MFS_QMM_TUNE", "false")])
def test_a_bad_value_is_refused_naming_the_variable(name, value):
    with pytest.raises(ValueError, match=f"{name}='{value}': expected one of"):
        Switches.from_env({name: value})


def test_an_operator_switch_is_one_of_the_documented_ones():
    s = Switches(operators_off=frozenset({"MFS_CPU_ARGMAX"}))
    assert [s.operator_on(n) for n in OPERATORS] == [n != "MFS_CPU_ARGMAX" for n in OPERATORS]
    with pytest.raises(ValueError, match="not an operator switch"):
        s.operator_on("MFS_CPU_ARGMAXX")


def test_read_once_then_kept_until_use(switch_env, monkeypatch):
    switch_env(MFS_W4A8_TILES="0")
    first = switches.current()
    assert not first.w4a8_tiles
    monkeypatch.setenv("MFS_W4A8_TILES", "1")  # the environment alone changes: not read again
    assert switches.current() is first
    switches.use(None)
    assert switches.current().w4a8_tiles and switches.current() is not first
    switches.use(Switches(kernels="torch"))
    assert switches.current() == Switches(kernels="torch")


def test_the_kernels_and_the_formats_take_them_from_there(switch_env):
    from kernels import select_backend
    from worker.formats import resolve
    from worker.formats.int8 import tiles
    switch_env(MFS_W4A8_TILES="0", MFS_KERNELS="torch")
    assert resolve("int8").switches is switches.current() and not resolve("int8").tiles and not tiles(32)
    assert select_backend(None, "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        select_backend("cuda", "cpu")
    switch_env(MFS_W4A8_TILES=None)
    assert tiles(32) and not tiles(40)


def test_no_other_module_reads_them():
    names = "|".join(["MFS_KERNELS", "MFS_CPU_GEMV_ISA", "MFS_NONDETERMINISTIC", "MFS_W4A8_TILES", "MFS_QMM_TUNE",
                      *OPERATORS])
    # os.environ.get("X"), os.getenv("X"), os.environ["X"] (not a write: a parent sets one for its children)
    read = re.compile(rf"(environ\.get\(|getenv\()\s*[\"']({names})[\"']|environ\[\s*[\"']({names})[\"']\s*\](?!\s*=)")
    readers = [str(p.relative_to(ROOT)) for pkg in ("core", "family", "kernels", "worker", "engine", "service",
                                                     "scheduler", "gateway", "benches", "evaluation", "training", "mfs")
               for p in (ROOT / pkg).rglob("*.py") if read.search(p.read_text())]
    assert readers == [], readers
