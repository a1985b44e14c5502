"""The building blocks of the gateway's OpenAPI document: JSON Schema helpers, and a declared request
parameter (core/params.py) as a schema, its bounds as the parser reads them."""
from __future__ import annotations

from core.params import PARAMS, Param


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    """``schema`` or JSON null (the validator reads a null field as "not given")."""
    return {"anyOf": [schema, {"type": "null"}]}


def obj(props: dict, required: list[str] | tuple[str, ...] = (), closed: bool = True, **kw) -> dict:
    out = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    out.update(kw)
    return out


def param_schema(p: Param) -> dict:
    """A declared parameter (core/params.py) as the parser reads it: its type and bounds, or null."""
    return nullable({**bounds_schema(p), "description": p.doc})


def bounds_schema(p: Param) -> dict:
    """A declared parameter's type and bounds (null aside)."""
    s: dict = {"type": p.json_type}
    if p.lo is not None:
        s["exclusiveMinimum" if p.lo_open else "minimum"] = num(p.lo)
    if p.hi is not None:
        s["exclusiveMaximum" if p.hi_open else "maximum"] = num(p.hi)
    return s


def at_path(name: str, description: str) -> dict:
    """The declared parameter a body carries at its path (``mfs.*``), described for that place."""
    return {**bounds_schema(PARAMS[name]), "description": description}


def num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # 2, not 2.0, in the document
