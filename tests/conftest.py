import pytest

from mfs.logs import configure

configure(level="WARNING")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from tests.factories import tiny_llama
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama_family(llama_dir):
    from mfs.family import load_family
    return load_family(str(llama_dir), tiers="2,4,6", dtype="float64")


@pytest.fixture(scope="session")
def default_family():
    from mfs.family import load_family
    return load_family("default")
