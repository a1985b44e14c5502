"""Where a worker's compiled graphs go (worker/service.py: ``inductor_cache_dir``): $MFS_CACHE/inductor unless
a user named another folder; torch's own default, which torch writes into a process's environment and its
children inherit, counts as unnamed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from worker.service import inductor_cache_dir


def test_unset_goes_under_mfs_cache(tmp_path):
    assert inductor_cache_dir({}, tmp_path) == str(tmp_path / "inductor")
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": ""}, tmp_path) == str(tmp_path / "inductor")


def test_a_folder_the_user_names_is_kept(tmp_path):
    mine = str(tmp_path / "elsewhere")
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": mine}, tmp_path / "mfs") == mine


def test_torchs_default_inherited_from_a_parent_counts_as_unset(tmp_path):
    # a parent that touched inductor's caches (as transformers' GGUF tokenizer load does) hands its
    # children torch's default; the child's worker still compiles under $MFS_CACHE
    parent = ("import os, subprocess, sys\n"
              "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
              "cache_dir()\n"
              "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
              "sys.stdout.flush()\n"
              "subprocess.run([sys.executable, '-c', 'import os, sys; from pathlib import Path; "
              "from worker.service import inductor_cache_dir; "
              "print(inductor_cache_dir(os.environ, Path(sys.argv[1])))', sys.argv[1]], check=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", parent, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parents[1], check=True).stdout.split()
    assert out == [os.path.abspath(default_cache_dir()), str(tmp_path / "inductor")]


@pytest.mark.parametrize("user", ["root", "a\\b/c:d*e?f\"g<h>i|j", None])
def test_torchs_default_is_computed_as_torch_computes_it(monkeypatch, user):
    """The worker names torch's default folder without importing inductor: the same path as torch's own
    function, for a plain user name, one with the characters torch replaces, and none to be had."""
    import getpass

    from worker.service import torch_default_inductor_dir

    def getuser():
        if user is None:
            raise KeyError("no user")
        return user
    monkeypatch.setattr(getpass, "getuser", getuser)
    assert torch_default_inductor_dir() == default_cache_dir()


def test_a_kernels_key_does_not_depend_on_where_torch_is_installed(tmp_path, monkeypatch):
    """worker.compiled_step.stable_kernel_keys: the same kernel source and flags under another install's
    torch path hash to the key this install's do (a second clone finds the kernels built); another path
    than this torch's is left as it is."""
    import torch
    from torch._inductor import codecache

    from worker.compiled_step import stable_kernel_keys
    monkeypatch.setattr(codecache, "write", codecache.write)  # put back as it was after the test
    stable_kernel_keys()
    install, src = os.path.dirname(torch.__file__), "int main() { return 0; }"

    def key(flags: str) -> str:
        return codecache.write(src, "cpp", extra=flags, specified_dir=str(tmp_path))[0]
    here = key(f"g++ -I{install}/include -L{install}/lib")
    assert here == key(f"g++ -I<torch {torch.__version__}>/include -L<torch {torch.__version__}>/lib")
    assert here != key("g++ -I/elsewhere/torch/include -L/elsewhere/torch/lib")
