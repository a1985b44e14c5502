"""Typed readers of one request-body field: each returns the value (or the default when it is absent)
or raises a 400 that names the field. Shared by the request parsers (``gateway.openai_api``, the
``mfs`` extension, structured output and the refused-parameter table)."""
from __future__ import annotations

import math

from core.params import INT32_MAX, Param  # noqa: F401 (the parsers read INT32_MAX here)
from gateway.errors import invalid


def int_field(body: dict, name: str, lo: int | None = None, hi: int | None = None,
         param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    param = param or name
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{param}' must be an integer, got {short(v)}.", param)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid(f"'{param}' must be {bounds}, got {v}.", param)
    return v


def param_field(obj: dict, key: str, p: Param, where: str) -> object | None:
    """A declared parameter (core/params.py) read from ``obj[key]`` against its declaration: its value,
    or None when absent or null; a 400 naming ``where`` (the field's path in the body) when out of it."""
    v = obj.get(key)
    if v is None:
        return None
    if p.kind is int and isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)  # JSON 4.0 is the integer 4 (as JSON Schema reads it)
    if (why := p.problem(v)) is not None:
        raise invalid(f"'{where}' {why}, got {short(v)}.", where)
    return float(v) if p.kind is float else v


def short(v, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{name}' must be a boolean, got {v!r}.", name)
    return v


def only_fields(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        raise invalid(f"'{where}' has an unknown field {short(extra[0], 40)}; it takes "
                      f"{', '.join(allowed)}.", where)
