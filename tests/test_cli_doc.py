"""docs/CLI.md is what the parsers say: regenerate it with `.venv/bin/python tools/gen_cli_doc.py` after
changing a flag."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_cli_doc", ROOT / "tools" / "gen_cli_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cli_reference_is_current():
    gen = load_generator()
    text = gen.render()
    assert "## `mfs up`" in text and "### `mfs bench engine`" in text and "--weights" in text
    assert (ROOT / "docs" / "CLI.md").read_text() == text, \
        "docs/CLI.md is stale: run .venv/bin/python tools/gen_cli_doc.py"
