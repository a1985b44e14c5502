"""The ``mfs`` body extension, multi-level sampling as a request asks for it: ``{"speculative": {...} |
false, "cascade": {...} | false}``, checked for type and range here (against the tiers and the server
defaults: ``Service.multilevel`` in ``gateway.serving``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from core.params import PARAMS
from gateway.errors import invalid
from gateway.fields import int_field, only_fields, short

MAX_SPEC_GAMMA = int(PARAMS["spec_gamma"].hi)          # draft tokens per verification round
MAX_CASCADE_WINDOW = int(PARAMS["cascade_window"].hi)  # tokens the cascade's confidence is averaged over


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


def _speculative(v) -> Speculative | bool | None:
    name = "mfs.speculative"
    if v is None or v is False:
        return v
    if v is True:
        return Speculative()
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object {{\"draft\": <tier>, \"gamma\": <int>, "
                      f"\"stop_confidence\": <0..1>}} or false, got {short(v)}.", name)
    only_fields(v, ("draft", "gamma", "stop_confidence"), name)
    draft = v.get("draft")
    if isinstance(draft, float) and draft.is_integer():
        draft = int(draft)
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, (str, int)) or draft == ""):
        raise invalid(f"'{name}.draft' must be a tier name, a model id or a tier index, got "
                      f"{short(draft)}.", f"{name}.draft")
    gamma = int_field(v, "gamma", lo=1, hi=MAX_SPEC_GAMMA, param=f"{name}.gamma")
    stop = v.get("stop_confidence")
    if stop is not None:
        if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not math.isfinite(stop) \
                or not 0 <= stop <= 1:
            raise invalid(f"'{name}.stop_confidence' must be a number between 0 and 1, got {short(stop)}.",
                          f"{name}.stop_confidence")
        stop = float(stop)
    return Speculative(draft, gamma, stop)


def _cascade(v) -> Cascade | bool | None:
    name = "mfs.cascade"
    if v is None or v is False:
        return v
    if v is True:
        return Cascade()
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object {{\"threshold\": <0..1>, \"window\": <int>}} or false, "
                      f"got {short(v)}.", name)
    only_fields(v, ("threshold", "window"), name)
    t = v.get("threshold")
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t < 1:
            raise invalid(f"'{name}.threshold' must be a number strictly between 0 and 1, got {short(t)}.",
                          f"{name}.threshold")
        t = float(t)
    window = int_field(v, "window", lo=1, hi=MAX_CASCADE_WINDOW, param=f"{name}.window")
    return Cascade(t, window)


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
