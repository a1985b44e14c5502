import os

import pytest

from core.logs import configure
from family.source import cache_root

# OpenMP threads that find no work sleep at once instead of spinning first (libgomp reads this when
# torch loads it, later than here; every process the tests start inherits it). The suite runs one
# more process than the cores, each with torch's threads as many as the cores, so a spinning thread
# takes a core that another process's work is waiting for. It changes no result, only how an idle
# thread waits: three copies of test_speculative's distribution test at once on 2 cores took 150 s
# of CPU (76 s wall) spinning as libgomp does by default, 59 s (30 s) with PASSIVE.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One inductor cache for the tests' own processes and the workers they start: the workers' folder,
# $MFS_CACHE/inductor (worker/service.py), where torch's default would be /tmp/torchinductor_<user>.
# A graph one test compiled is then loaded, not compiled again, by a test in another process.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))

configure(level="WARNING")


def pytest_configure(config):
    """One torch thread in the suite's own processes. Their runners, kernels and compiled graphs run
    in-process, TEST_WORKERS of them on the cores, so a second intra-op thread finds no idle core and
    only adds its wake-ups (about a tenth more CPU for the compiled-step and quantized-matmul files on 2
    cores). The services the tests start
    choose their own (--threads), and tests of threading set theirs."""
    import torch
    torch.set_num_threads(1)


def pytest_collection_modifyitems(session, config, items):
    """The costliest test files first, each file's tests in their own order (tests/support/costs.py)."""
    from tests.support import costs
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {f: i for i, f in enumerate(costs.order(files, costs.load()))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from tests.support.factories import tiny_llama
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama_family(llama_dir):
    from worker.family import load_family
    return load_family(str(llama_dir), tiers="2,4,6", dtype="float64")


@pytest.fixture(scope="module")
def exit_family(llama_dir):
    """The tiny Llama with an exit block under tiers 0 and 1, perturbed to look trained: tests of the
    plain nested model take it as a second family (test_exit_blocks.py says why)."""
    from tests.support.factories import perturb_exits
    from worker.family import load_family
    fam = load_family(str(llama_dir), tiers="2+1,4+1,6", dtype="float64")
    perturb_exits(fam, 5)
    return fam


@pytest.fixture(scope="session")
def frontend():
    """The default family's names and tokenizer (no weights): what a gateway loads. Its quality record
    is dropped, so every tier is routable: the gateway tests exercise routing by complexity on every
    tier, and the quality floor has tests of its own (test_gateway.py)."""
    from family.manifest import load_frontend
    fe = load_frontend("default")
    fe.manifest.quality = None
    return fe


@pytest.fixture(scope="session")
def default_family():
    from worker.family import load_family
    return load_family("default")


@pytest.fixture
def switch_env(monkeypatch):
    """``switch_env(MFS_X="0", MFS_Y=None)``: sets (None: unsets) ``MFS_*`` switches for one test and has
    the process read them again (kernels/switches.py reads them once); both undone after the test."""
    from kernels import switches
    monkeypatch.setattr(switches, "_current", [])

    def set_switches(**env: str | None) -> None:
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        switches.use(None)
    return set_switches

# Triton fixes its library functions to GPU or interpreter mode when it is first imported: make every
# test process use the CPU interpreter unless a GPU run asks otherwise.
if not os.environ.get("MFS_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
