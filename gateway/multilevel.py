"""The ``mfs`` body extension, multi-level sampling as a request asks for it: ``{"speculative": {...} |
false, "cascade": {...} | false}``, checked for type and range here, each field against the parameter
declared at its path (core/params.py), and against the tiers and the server defaults in
``Service.multilevel`` (``gateway.serving``)."""
from __future__ import annotations

from dataclasses import dataclass

from core.params import PARAMS
from gateway.errors import invalid
from gateway.fields import only_fields, param_field, short


@dataclass(slots=True, frozen=True)
class Speculative:
    """``mfs.speculative`` as the request asked it (validated for type and range, not yet for tiers)."""
    draft: str | int | None = None   # tier name, model id or index; None: the server's --spec-draft-tier
    gamma: int | None = None         # None: the server's --spec-gamma
    stop_confidence: float | None = None  # None: SamplingParams' default


@dataclass(slots=True, frozen=True)
class Cascade:
    """``mfs.cascade`` as the request asked it."""
    threshold: float | None = None   # None: the server's --cascade-threshold
    window: int | None = None        # None: the server's --cascade-window


@dataclass(slots=True, frozen=True)
class MultiLevel:
    """The ``mfs`` body extension. Each field: None (the server default applies), False (off, whatever
    the server default), or what the request asked for."""
    speculative: Speculative | bool | None = None
    cascade: Cascade | bool | None = None


def declared(obj: dict, name: str) -> object | None:
    """The field of ``obj`` that carries the declared parameter ``name`` (its path's last part), read
    against its declaration; None when absent or null."""
    p = PARAMS[name]
    return param_field(obj, p.path.rsplit(".", 1)[1], p, p.path)


def _speculative(v) -> Speculative | bool | None:
    name = "mfs.speculative"
    if v is None or v is False:
        return v
    if v is True:
        return Speculative()
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object {{\"draft\": <tier>, \"gamma\": <int>, "
                      f"\"stop_confidence\": <number>}} or false, got {short(v)}.", name)
    only_fields(v, ("draft", "gamma", "stop_confidence"), name)
    draft = v.get("draft")
    if isinstance(draft, float) and draft.is_integer():
        draft = int(draft)
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, (str, int)) or draft == ""):
        raise invalid(f"'{name}.draft' must be a tier name, a model id or a tier index, got "
                      f"{short(draft)}.", f"{name}.draft")
    return Speculative(draft, declared(v, "spec_gamma"), declared(v, "spec_stop_confidence"))


def _cascade(v) -> Cascade | bool | None:
    name = "mfs.cascade"
    if v is None or v is False:
        return v
    if v is True:
        return Cascade()
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object {{\"threshold\": <number>, \"window\": <int>}} or "
                      f"false, got {short(v)}.", name)
    only_fields(v, ("threshold", "window"), name)
    return Cascade(declared(v, "cascade_threshold"), declared(v, "cascade_window"))


def parse_multilevel(body: dict) -> MultiLevel:
    """The ``mfs`` extension field: ``{"speculative": {...} | false, "cascade": {...} | false}``."""
    v = body.get("mfs")
    if v is None:
        return MultiLevel()
    if not isinstance(v, dict):
        raise invalid(f"'mfs' must be an object, got {short(v)}.", "mfs")
    only_fields(v, ("speculative", "cascade"), "mfs")
    ml = MultiLevel(_speculative(v.get("speculative")), _cascade(v.get("cascade")))
    if isinstance(ml.speculative, Speculative) and isinstance(ml.cascade, Cascade):
        raise invalid("A request may ask for self-speculative decoding or for a confidence cascade, not both "
                      "('mfs.speculative' and 'mfs.cascade').", "mfs")
    return ml
