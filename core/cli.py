"""Command lines generated from config dataclasses: one dataclass per process says every knob once (name,
type, default, help), ``add_args`` turns its fields into argparse flags and ``from_args`` builds the
dataclass back from the parsed namespace, so nothing below ``main()`` sees an argparse namespace.

A field's flag comes from its name (``max_num_seqs`` -> ``--max-num-seqs``), its type from the
annotation (int, float, str, ``X | None``, ``Literal[...]`` as choices), its default from the field's
default (or default factory). A bool field is a switch: ``--x`` (store_true) when it defaults to False,
``--no-x`` (store_false) when it defaults to True. The rest is per-field metadata, given with :func:`opt`:

- ``help``: the flag's help text, or a function returning it when the parser is built (a list that
  grows at run time, as the registered weight formats);
- ``flag``: another flag name (``--request-timeout`` for ``request_timeout_s``);
- ``parse``: turns the flag's string into the field's value (a ValueError becomes an argparse error
  that shows its message);
- ``group``: the title of an argument group the caller made (see ``add_args``);
- ``cli=False``: no flag (the caller fills the field, or its default stands).

Torch-free and Redis-free: the scheduler and gateway import it."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, Literal


def opt(default: Any = dataclasses.MISSING, help: str | Callable[[], str] = "", *, flag: str | None = None,  # noqa: A002
        parse: Callable[[str], Any] | None = None, group: str | None = None, cli: bool = True,
        default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its command-line metadata (see the module docstring)."""
    meta = {"help": help, "flag": flag, "parse": parse, "group": group, "cli": cli}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"cli": meta})


def _meta(f: dataclasses.Field) -> dict:
    return f.metadata.get("cli") or {"help": "", "flag": None, "parse": None, "group": None, "cli": True}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def positive_int(s: str) -> int:
    """An argparse type: a whole number of at least 1 (a size or a count), else a message naming the value."""
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {s!r}")
    return v


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse shows a type function's ArgumentTypeError message, but only "invalid value" for a
    ValueError: re-raise it as the former so the error says what is wrong."""
    def run(s: str) -> Any:
        try:
            return parse(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    run.__name__ = getattr(parse, "__name__", "value")
    return run


def _kind(tp: Any) -> tuple[Callable[[str], Any] | None, list | None]:
    """(argparse type, choices) for an annotation: ``X | None`` is X; a union with str is str."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else str
    if typing.get_origin(tp) is Literal:
        choices = list(typing.get_args(tp))
        return type(choices[0]), choices
    if tp in (int, float, str):
        return tp, None
    return None, None


def _flag(f: dataclasses.Field, meta: dict, default: Any, is_bool: bool) -> str:
    if meta["flag"]:
        return meta["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if is_bool and default else f"--{name}"


def add_args(p: argparse.ArgumentParser, cls: type, groups: dict[str, Any] | None = None) -> None:
    """Adds a flag for each field of ``cls`` (in field order); a field whose ``group`` names one of
    ``groups`` (title -> an argument group of ``p``) goes into that group."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        if not meta["cli"]:
            continue
        target = (groups or {}).get(meta["group"], p) if meta["group"] else p
        default, tp = _default(f), hints[f.name]
        is_bool = tp is bool
        text = meta["help"]() if callable(meta["help"]) else meta["help"]
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": text or None}
        if is_bool:
            kw["action"] = "store_false" if default else "store_true"
        else:
            conv, choices = _kind(tp)
            if meta["parse"] is not None:
                conv = _checked(meta["parse"])
            elif conv is None:
                raise TypeError(f"{cls.__name__}.{f.name}: no flag for {tp!r} without a parse function")
            kw["type"] = conv
            if choices is not None:
                kw["choices"] = choices
            elif meta["flag"]:  # named after the flag, not the field
                kw["metavar"] = meta["flag"].lstrip("-").replace("-", "_").upper()
        target.add_argument(_flag(f, meta, default, is_bool), **kw)


def from_args(cls: type, ns: argparse.Namespace, **given: Any) -> Any:
    """``cls`` built from the parsed flags of its fields, plus ``given`` (fields without a flag, or
    nested configs); a field with neither keeps its default."""
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
          if _meta(f)["cli"] and hasattr(ns, f.name)}
    kw.update(given)
    return cls(**kw)

