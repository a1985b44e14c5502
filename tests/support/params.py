"""Values that probe a declared request parameter (core/params.py): around each bound and of the wrong
type. Shared by tests/test_params.py (the parser, the schema and validate) and tests/test_params_api.py
(the same through the HTTP API)."""
from __future__ import annotations

from core.params import Param


def probes(p: Param) -> list:
    """Values around each bound, and of the wrong type."""
    step = 1 if p.kind is int else 0.25
    out: list = ["0.5", [1], {"a": 1}]
    out += [True, False, 1, 0, 0.5] if p.kind is bool else [True, False]
    if p.kind is int:
        out += [2.5]  # not an integer (4.0 is: JSON reads it so)
    for end, sign in ((p.lo, -1), (p.hi, 1)):
        if end is not None:
            out += [end + sign * step, end, end - sign * step]
            if p.kind is float:
                out += [int(end)] if float(end).is_integer() else []
    return out


def coerced(p: Param, v):
    """What the gateway reads ``v`` as: JSON 4.0 is the integer 4 for an integer parameter."""
    if p.kind is int and isinstance(v, float) and v.is_integer():
        return int(v)
    return v
