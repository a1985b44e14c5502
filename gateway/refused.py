"""The request fields OpenAI (and vLLM) define that this server does not implement, and the check that
refuses them (a 400 ``unsupported_parameter`` naming the field; never accepted and ignored)."""
from __future__ import annotations

import json

from gateway.errors import invalid
from gateway.fields import int_field

# OpenAI (and vLLM) request fields this server does not implement: only the values that mean "off"
# are accepted (compared type-strictly, as JSON Schema's enum does); anything else is a 400
# unsupported_parameter naming the field, never accepted and ignored. gateway/openapi.py describes
# each with exactly these values.
NO_TOOLS = "tools and function calling are not supported"
NO_STRUCTURED = ("only response_format, guided_json, guided_regex and guided_choice give structured output "
                 "here")
REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "insertion ('suffix') is not supported"),
    "guided_grammar": ((None,), NO_STRUCTURED),
    "structured_outputs": ((None,), NO_STRUCTURED),
    "tool_choice": ((None, "none", "auto"), NO_TOOLS),
    "function_call": ((None, "none", "auto"), NO_TOOLS),
    "parallel_tool_calls": ((None, True), NO_TOOLS),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "these models do not reason on a budget"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "completions are not stored"),
    "metadata": ((None, {}), "completions are not stored (metadata goes with 'store')"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def check_refused(body: dict) -> None:
    best_of = int_field(body, "best_of", lo=1)
    if best_of not in (None, 1):
        raise invalid("'best_of' > 1 is not supported.", "best_of", code="unsupported_parameter")
    for name in ("tools", "functions"):
        if body.get(name):
            raise invalid(f"'{name}': {NO_TOOLS}.", name, code="unsupported_parameter")
    for name, (off, why) in REFUSED.items():
        v = body.get(name)
        if not any(_same(v, o) for o in off):
            allowed = " or ".join(json.dumps(o) for o in off)
            shown = json.dumps(v, default=str)
            shown = shown if len(shown) <= 60 else shown[:60] + "..."
            raise invalid(f"'{name}': {shown} is not supported: {why}. Leave it out (or send {allowed}).",
                          name, code="unsupported_parameter")
