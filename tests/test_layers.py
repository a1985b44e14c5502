"""The layering, checked on the real imports: what a process loads is what its modules import."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loaded_by(module: str) -> set[str]:
    """Top-level names in sys.modules after a fresh interpreter imports `module` (and nothing else)."""
    code = f"import json, sys, {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize("module", ["scheduler.service", "scheduler.core", "core.protocol", "core.sampling",
                                    "kvstore.directory", "gateway.app"])
def test_process_modules_without_torch(module):
    """The scheduler and gateway processes never load torch: request-level types live in core/."""
    loaded = loaded_by(module)
    assert "core" in loaded or module.startswith("core")
    assert "torch" not in loaded
    assert "worker" not in loaded
