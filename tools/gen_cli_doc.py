"""Writes docs/CLI.md, the command-line reference, from the parsers themselves (mfs.cli.build_parser):
every command and bench with its help. usage: .venv/bin/python tools/gen_cli_doc.py [--check]
(--check: exit 1 when docs/CLI.md differs from what the parsers say; tests/test_cli_doc.py runs it)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "CLI.md"
WIDTH = "100"  # argparse wraps help to the terminal's width: fixed, so the file is the same everywhere

HEADER = """# The `mfs` command line

Generated from the parsers by `tools/gen_cli_doc.py` (do not edit by hand: run
`.venv/bin/python tools/gen_cli_doc.py` after changing a flag; `tests/test_cli_doc.py` fails while this
file is stale). Every command also prints this with `--help`.
"""


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _helps(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help, as `mfs --help` lists it."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return {c.dest: (c.help or "").replace("%%", "%") for c in a._choices_actions}  # as argparse prints it
    return {}


def _section(level: str, name: str, summary: str, p: argparse.ArgumentParser) -> list[str]:
    out = [f"{level} `{name}`", ""]
    if summary:
        out += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    return out + ["```text", p.format_help().rstrip(), "```", ""]


def render() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        from mfs.cli import build_parser  # noqa: PLC0415 (after COLUMNS: formatters read it)
        top = build_parser()
        lines = [HEADER, "```text", top.format_help().rstrip(), "```", ""]
        commands, helps = _subparsers(top), _helps(top)
        index = [f"- [`mfs {n}`](#mfs-{n.replace(' ', '-')}): {helps.get(n, '')}" for n in commands]
        lines[1:1] = ["## Commands", "", *index, ""]
        for name, p in commands.items():
            lines += _section("##", f"mfs {name}", helps.get(name, ""), p)
            sub, sub_helps = _subparsers(p), _helps(p)
            for sname, sp in sub.items():
                lines += _section("###", f"mfs {name} {sname}", sub_helps.get(sname, ""), sp)
        return "\n".join(lines).rstrip() + "\n"
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/CLI.md is stale; write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run .venv/bin/python tools/gen_cli_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
