"""The ``mfs`` command line. Each subcommand lives in its own module and registers itself through an
``add_parser(subparsers)`` function that sets ``func`` to the callable taking the parsed args."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, attribute) of each subcommand's add_parser, in the order `mfs --help` lists them.
COMMANDS = [
    ("mfs.commands", "add_generate"),
    ("mfs.commands", "add_tiers"),
    ("mfs.commands", "add_up"),
    ("training.precipitate", "add_parser"),
    ("evaluation.evaluate", "add_parser"),
    ("evaluation.lm_eval_run", "add_parser"),
    ("mfs.gpu_precipitate", "add_parser"),
]
BENCHES = [
    ("benches.engine", "add_parser"),
    ("benches.kernels", "add_parser"),
    ("benches.linears", "add_parser"),
    ("benches.step", "add_parser"),
    ("benches.peers", "add_parser"),
    ("benches.serve", "add_parser"),
    ("benches.spec", "add_parser"),
    ("benches.route", "add_parser"),
    ("benches.control_plane", "add_parser"),
    ("benches.grammar", "add_parser"),
    ("benches.load", "add_parser"),
    ("benches.chaos", "add_parser"),
    ("benches.determinism", "add_parser"),
    ("benches.cuts", "add_parser"),
    ("benches.startup", "add_parser"),
]


def _register(sub, entries) -> None:
    for mod, attr in entries:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # a real missing dependency inside the module: surface it
                raise
            continue  # that command is not part of this build yet
        getattr(module, attr)(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mfs", description="Serve an LLM model family from one nested model.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _register(sub, COMMANDS)
    bench = sub.add_parser("bench", help="benchmarks (engine, kernels, serve, spec, control-plane, ...)")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _register(bsub, BENCHES)
    return p


def main(argv: list[str] | None = None) -> int:
    from core.logs import configure  # noqa: PLC0415
    configure(level=os.environ.get("MFS_LOG_LEVEL", "WARNING"))
    return run(argv)


def run(argv: list[str] | None = None) -> int:
    """One command, its exit status returned (argparse's usage errors exit 2 through SystemExit)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"mfs {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
