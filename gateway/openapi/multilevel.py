"""The ``mfs`` extension in the gateway's OpenAPI document: self-speculative decoding and the confidence
cascade, and the rules that depend on ``model`` (a tier model id takes no cascade and only drafts below
it), exactly as ``gateway.multilevel`` and ``gateway.serving`` check them."""
from __future__ import annotations

from core.sampling import SamplingParams
from gateway.openapi.facts import Facts
from gateway.openapi.schema import at_path, nullable, obj, ref


def _draft(f: Facts, top: int) -> dict:
    """A reference to a tier with index 0..top: its name, its model id, its index, or the index as
    a string of at most 5 ASCII digits (how ``Service.resolve_tier`` reads it)."""
    refs = [f.tier_names[i] for i in range(top + 1)] + [f.tier_ids[i] for i in range(top + 1)]
    alts = [{"type": "string", "enum": list(dict.fromkeys(refs))},
            {"type": "integer", "minimum": 0, "maximum": top}]
    if top <= 9:
        alts.append({"type": "string", "pattern": f"^0{{0,4}}[0-{top}]$"})
    return {"anyOf": alts, "description": "A tier below the request's: its name ("
            + ", ".join(f.tier_names[:top + 1]) + "), model id or index."}


def _speculative(f: Facts, top: int | None) -> dict:
    """``mfs.speculative`` for a request whose possible drafts are tiers 0..top (None: none)."""
    gamma = nullable(at_path("spec_gamma", f"Draft tokens per verification round (server default "
                                           f"{f.default_gamma})."))
    has_default = f.default_draft is not None
    values: list = [None, False] + ([True] if has_default else [])
    alts: list[dict] = [{"enum": values}]
    if top is not None or has_default:
        if top is None:
            draft = {"type": "null"}
        else:
            draft = nullable(_draft(f, top)) if has_default else _draft(f, top)
        stop = nullable(at_path("spec_stop_confidence", "A round ends before 'gamma' drafts when the draft "
                                "tier's top-token probability for its latest draft falls below this (0: "
                                f"always 'gamma'; default {SamplingParams().spec_stop_confidence})."))
        alts.append(obj({"draft": draft, "gamma": gamma, "stop_confidence": stop},
                         [] if has_default else ["draft"]))
    default = (f"true: the server's defaults (draft tier '{f.tier_names[f.default_draft]}')" if has_default
               else "this server has no default draft tier: 'draft' is required")
    return {"anyOf": alts, "description": "Self-speculative decoding: a lower tier drafts, the request's tier "
            f"verifies. {default}; false: off."}


def _cascade(f: Facts) -> dict:
    has_default = f.default_threshold is not None
    threshold = at_path("cascade_threshold", "Escalate one tier up when the mean top-token probability of "
                        "the last 'window' tokens falls below it (1: at the end of every window; 0: never).")
    window = nullable(at_path("cascade_window", f"Tokens the confidence is averaged over (server default "
                                                f"{f.default_window})."))
    asked = obj({"threshold": nullable(threshold) if has_default else threshold, "window": window},
                 [] if has_default else ["threshold"])
    default = (f"true: the server's defaults (threshold {f.default_threshold:g})" if has_default
               else "this server has no default threshold: 'threshold' is required")
    return {"anyOf": [{"enum": [None, False] + ([True] if has_default else [])}, asked],
            "description": "Confidence cascade from the scored tier up; only for the family id or 'auto'. "
                           f"{default}; false: off."}


_ASKS = {"anyOf": [{"const": True}, {"type": "object"}]}


def _multilevel(spec: dict, cascade: dict) -> dict:
    return nullable(obj(
        {"speculative": spec, "cascade": cascade},
        # asking for both explicitly is a 400 ('mfs')
        **{"not": {"required": ["speculative", "cascade"],
                   "properties": {"speculative": _ASKS, "cascade": _ASKS}}},
        description="MFS multi-level sampling (see the gateway README): self-speculative decoding or a "
                    "confidence cascade, not both. null or a missing field: the server's default."))


def per_model(f: Facts) -> list[dict]:
    """The ``mfs`` rules depend on ``model``: a tier model id takes no cascade and only drafts below it;
    the family id / ``auto`` takes either (its draft is checked against the scored tier later)."""
    no_cascade = {"enum": [None, False]}
    alts = [{"properties": {"model": {"enum": [f.family, "auto"]}, "mfs": ref("MultiLevel")},
             "description": "The family id: the gateway picks the tier; either kind of 'mfs'."}]
    for k, tid in enumerate(f.tier_ids):
        below = f"drafts from {', '.join(f.tier_names[:k])}" if k else "no draft"
        alts.append({"properties": {"model": {"const": tid},
                                    "mfs": _multilevel(_speculative(f, k - 1 if k else None), no_cascade)},
                     "description": f"Tier '{f.tier_names[k]}': no cascade, {below}."})
    return alts


def multilevel_schema(f: Facts) -> dict:
    """The ``MultiLevel`` component: the ``mfs`` field a family-id (or ``auto``) request may carry."""
    return _multilevel(_speculative(f, len(f.tier_ids) - 2 if len(f.tier_ids) > 1 else None), _cascade(f))
