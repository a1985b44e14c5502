"""The ``mfs`` command line. Each subcommand lives in its own module and registers itself through an
``add_parser(subparsers)`` function that sets ``func`` to the callable taking the parsed args."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# (command, module, attribute) of each subcommand's add_parser, in the order `mfs --help` lists them. A
# command's own module is the only one imported to run it (most import torch); the
# name is checked against what that add_parser registers whenever the whole table is read (`mfs --help`).
COMMANDS = [
    ("generate", "mfs.commands", "add_generate"),
    ("tiers", "mfs.commands", "add_tiers"),
    ("up", "mfs.commands", "add_up"),
    ("precipitate", "training.precipitate", "add_parser"),
    ("eval", "evaluation.evaluate", "add_parser"),
    ("lm-eval", "evaluation.lm_eval_run", "add_parser"),
    ("gpu-precipitate", "mfs.gpu_precipitate", "add_parser"),
]
BENCHES = [(name, "benches." + name.replace("-", "_"), "add_parser") for name in (
    "engine", "kernels", "linears", "step", "peers", "serve", "spec", "route", "control-plane", "grammar", "load",
    "chaos", "determinism", "cuts", "startup")]


def _register(sub, entries, word: str | None) -> None:
    """The subcommands of ``entries``: only ``word``'s where it names one, else all of them."""
    chosen = [e for e in entries if e[0] == word] or entries
    for name, mod, attr in chosen:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # a real missing dependency inside the module: surface it
                raise
            continue  # that command is not part of this build yet
        getattr(module, attr)(sub)
        if name not in sub.choices:
            raise RuntimeError(f"mfs.cli names {name!r} for {mod}.{attr}, which registers {sorted(sub.choices)}")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """``mfs``'s parser. Given the command line, only the command it names is registered (its module
    alone imported); without one, or where the name is not a command, every command is."""
    argv = list(argv or [])
    word = argv[0] if argv else None
    p = argparse.ArgumentParser(prog="mfs", description="Serve an LLM model family from one nested model.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if word != "bench":
        _register(sub, COMMANDS, word)
    if word == "bench" or not any(e[0] == word for e in COMMANDS):
        bench = sub.add_parser("bench", help="benchmarks (engine, kernels, serve, spec, control-plane, ...)")
        bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
        _register(bsub, BENCHES, argv[1] if word == "bench" and len(argv) > 1 else None)
    return p


def main(argv: list[str] | None = None) -> int:
    from core.logs import configure  # noqa: PLC0415
    configure(level=os.environ.get("MFS_LOG_LEVEL", "WARNING"))
    return run(argv)


def run(argv: list[str] | None = None) -> int:
    """One command, its exit status returned (argparse's usage errors exit 2 through SystemExit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"mfs {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
