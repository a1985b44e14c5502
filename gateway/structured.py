"""Structured output as a request asks for it: ``response_format`` (json_object, json_schema) or one of
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``, at most one, as a :class:`Grammar`.
Checked here for shape; whether it compiles, by the serving layer (``gateway.serving``, with the
worker's grammar engine)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from core.sampling import MAX_GRAMMAR_CHARS
from gateway.errors import invalid
from gateway.fields import only_fields, short

MAX_CHOICES = 256        # guided_choice strings
# the structured-output fields: at most one per request
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice")


@dataclass(slots=True, frozen=True)
class Grammar:
    """Structured output as the request asked it: core.sampling's (kind, text), and the field it came
    from (a 400 about it names that field)."""
    kind: str   # "json" (text: a JSON schema), "regex", "choice" (text: a JSON list of strings)
    text: str
    param: str


def _text(v, param: str) -> str:
    if len(v) > MAX_GRAMMAR_CHARS:
        raise invalid(f"'{param}' may have at most {MAX_GRAMMAR_CHARS} characters, got {len(v)}.", param)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{param}' is not valid Unicode text.", param) from None
    return v


def _schema(v, param: str) -> str:
    """A JSON schema (an object) -> its text."""
    if not isinstance(v, dict):
        raise invalid(f"'{param}' must be a JSON schema (an object), got {short(v)}.", param)
    return _text(json.dumps(v, ensure_ascii=False), param)  # key order kept: it is the output's


def _response_format(v) -> Grammar | None:
    name = "response_format"
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(f"'{name}' must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                      f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}, "
                      f"got {short(v)}.", name)
    if v["type"] != "json_schema":
        only_fields(v, ("type",), name)
        return None if v["type"] == "text" else Grammar("json", '{"type": "object"}', name)
    only_fields(v, ("type", "json_schema"), name)
    js = v.get("json_schema")
    where = f"{name}.json_schema"
    if not isinstance(js, dict):
        raise invalid(f"'{where}' must be an object {{\"name\", \"schema\", \"strict\", \"description\"}}.", where)
    only_fields(js, ("name", "schema", "strict", "description"), where)
    n = js.get("name")
    if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", n):
        raise invalid(f"'{where}.name' is required: 1 to 64 letters, digits, '_' or '-', got {short(n)}.",
                      f"{where}.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise invalid(f"'{where}.strict' must be a boolean.", f"{where}.strict")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise invalid(f"'{where}.description' must be a string.", f"{where}.description")
    if js.get("schema") is None:
        raise invalid(f"'{where}.schema' is required: the JSON schema the output follows.", f"{where}.schema")
    return Grammar("json", _schema(js["schema"], f"{where}.schema"), f"{where}.schema")


def parse_grammar(body: dict) -> Grammar | None:
    """response_format (json_object, json_schema) or one of vLLM's guided_json / guided_regex /
    guided_choice: at most one. Checked here for shape; whether it compiles, by the gateway
    (gateway.serving, with the worker's grammar engine)."""
    found: list[Grammar] = []
    if body.get("response_format") is not None:
        g = _response_format(body["response_format"])
        if g is not None:
            found.append(g)
    if body.get("guided_json") is not None:
        found.append(Grammar("json", _schema(body["guided_json"], "guided_json"), "guided_json"))
    v = body.get("guided_regex")
    if v is not None:
        if not isinstance(v, str) or not v:
            raise invalid(f"'guided_regex' must be a non-empty regular expression, got {short(v)}.", "guided_regex")
        found.append(Grammar("regex", _text(v, "guided_regex"), "guided_regex"))
    v = body.get("guided_choice")
    if v is not None:
        if (not isinstance(v, list) or not v or len(v) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in v)):
            raise invalid(f"'guided_choice' must be a list of 1 to {MAX_CHOICES} non-empty strings, got "
                          f"{short(v)}.", "guided_choice")
        found.append(Grammar("choice", _text(json.dumps(v, ensure_ascii=False), "guided_choice"), "guided_choice"))
    if len(found) > 1:
        raise invalid("A request may constrain its output one way: " + ", ".join(STRUCTURED)
                      + f" (it has {found[0].param.split('.')[0]} and {found[1].param.split('.')[0]}).",
                      found[1].param.split(".")[0], code="conflicting_parameters")
    g = found[0] if found else None
    if g is not None and body.get("ignore_eos") is True:
        raise invalid(f"'ignore_eos' cannot go with structured output ('{g.param.split('.')[0]}'): the output "
                      "ends where its grammar does, with eos.", "ignore_eos", code="conflicting_parameters")
    return g
