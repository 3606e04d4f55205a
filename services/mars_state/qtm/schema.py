"""The controller's output contract (paper Table 5) as a JSON schema, derived from the proto `SessionState`
so the event schema stays the one definition, and the lenient parser for what controllers actually return.
"""

from __future__ import annotations

import functools
from typing import Any

from mars.domain.state_rules import ALLOWED_LENS, ALLOWED_TOP_K
from mars.llm_json import NoJsonObject, parse_json_object
from mars.v1 import events_pb2 as ev


def _enum_names(enum: Any) -> list[str]:
    # The proto's zero values (*_UNSPECIFIED) are "not set", never a controller answer.
    return [name for name in enum.keys() if not name.endswith("_UNSPECIFIED")]


@functools.cache
def qtm_json_schema() -> dict[str, Any]:
    """JSON schema of one controller answer: what `response_format` / guided decoding constrain to. Within
    OpenAI's strict subset (`mars.llm_json.strict_schema_violations`) but for the grammar-only maxLength."""
    return {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": _enum_names(ev.Action)},
            "query_type": {"type": "string", "enum": _enum_names(ev.QueryType)},
            "phase": {"type": "string", "enum": _enum_names(ev.Phase)},
            "taxonomy": {
                "type": "object",
                "properties": {
                    "need_memory": {"type": "integer", "enum": [0, 1]},
                    "memory_span": {"type": "string", "enum": _enum_names(ev.MemorySpan)},
                    "ambiguity": {"type": "string", "enum": _enum_names(ev.Ambiguity)},
                },
                "required": ["need_memory", "memory_span", "ambiguity"],
                "additionalProperties": False,
            },
            "lens_recommendation": {"type": "integer", "enum": list(ALLOWED_LENS)},
            "top_k_hint": {"type": "integer", "enum": list(ALLOWED_TOP_K)},
            "prefer_recent": {"type": "integer", "enum": [0, 1]},
            "retrieval_scope": {"type": "string", "enum": _enum_names(ev.RetrievalScope)},
            "lens_confidence": {"type": "number", "minimum": 0, "maximum": 1},
            # maxLength bounds the grammar dialect's output; strict mode rejects it, so the openai dialect
            # drops it (mars.llm_json.strict_subset) and the description asks for the same bound.
            "lens_reason": {"type": "string", "maxLength": 200, "description": "at most 200 characters"},
        },
        "required": [
            "action",
            "query_type",
            "phase",
            "taxonomy",
            "lens_recommendation",
            "top_k_hint",
            "prefer_recent",
            "retrieval_scope",
            "lens_confidence",
            "lens_reason",
        ],
        # Strict mode (OpenAI) rejects objects that allow extra keys; grammars then stop at the listed ones.
        "additionalProperties": False,
    }


# The parser is shared with the rubric judge; the QTM names are kept for its callers.
ControllerOutputError = NoJsonObject
parse_controller_output = parse_json_object
