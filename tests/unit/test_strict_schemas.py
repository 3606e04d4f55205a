"""Every JSON schema the code sends keeps to OpenAI's strict structured outputs (issue 12 item 2).

The QTM controller and the rubric judge are built the way the services build them and call a real local
HTTP server that answers like OpenAI: HTTP 400 when the `strict` schema breaks strict mode's rules
(`strict_schema_violations`), a completion otherwise. Before the fix the schemas had no
`additionalProperties: false`, so every call got the 400 and fell back to the rules / deterministic judge.
The llama.cpp dialect still receives a schema its server compiles to a grammar.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from mars.llm_json import strict_schema_violations, strict_subset
from mars.v1 import events_pb2 as ev
from mars_judge.rubric.judge import FLAG_FIELDS, SCORE_FIELDS, rubric_json_schema
from mars_judge.service import make_judge
from mars_judge.settings import JudgeSettings
from mars_state.qtm.controllers import make_controller
from mars_state.qtm.schema import qtm_json_schema

SERVICES = Path(__file__).resolve().parents[2] / "services"
PAPER_EXAMPLE = json.loads((Path(__file__).parent / "fixtures" / "qtm_paper_example.json").read_text())
JUDGEMENT = {
    "scores": {name: 4 for name in SCORE_FIELDS},
    "flags": {name: False for name in FLAG_FIELDS},
    "confidence": 0.9,
}
#: What each response_format name is answered with.
ANSWERS = {"qtm_state": PAPER_EXAMPLE, "turn_judgement": JUDGEMENT}


class StrictOpenAIServer:
    """A local /v1/chat/completions that records each request body and, like OpenAI, rejects a strict
    json_schema that breaks strict mode with HTTP 400 instead of answering."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                fmt = body["response_format"]
                status, reply = 200, ""
                if fmt["type"] == "json_schema":
                    spec = fmt["json_schema"]
                    problems = strict_schema_violations(spec["schema"]) if spec.get("strict") else []
                    if problems:
                        status, reply = 400, json.dumps({"error": {"message": "; ".join(problems)}})
                    else:
                        reply = json.dumps(ANSWERS[spec["name"]])
                else:  # llama.cpp's json_object carries no name: tell the two schemas apart by a property
                    judgement = "scores" in fmt["schema"]["properties"]
                    reply = json.dumps(ANSWERS["turn_judgement" if judgement else "qtm_state"])
                if status == 200:
                    completion = {
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}],
                        "usage": {"prompt_tokens": 300, "completion_tokens": 60},
                    }
                    reply = json.dumps(completion)
                data = reply.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def server() -> Iterator[StrictOpenAIServer]:
    s = StrictOpenAIServer()
    try:
        yield s
    finally:
        s.close()


def _generated() -> ev.Generated:
    g = ev.Generated(
        status=ev.OK, query="Plan my Lisbon days", text="Day 1: Alfama. Day 2: Belem.", model="m"
    )
    g.state.phase = ev.EXPLORE
    g.state.taxonomy.need_memory = 1
    g.packed_blocks.add(block_id="b1", text="User wants a calm Lisbon trip: Alfama, Belem, tram 28.")
    return g


async def _send_every_schema(url: str, backend: str) -> tuple[Any, ev.Judged]:
    """One QTM call and one judge call, through the clients the services build, against `url`."""
    controller = make_controller(backend, base_url=url, model="qwen")
    assert controller is not None
    try:
        reply = await controller.call("Make day two shorter.", ["Day 2: Belem and the tram."])
    finally:
        await controller.aclose()
    judge = make_judge(JudgeSettings(judge_backend=backend, judge_url=url))  # type: ignore[arg-type]
    try:
        judged = await judge.score(_generated(), lambda_cost=0.0)
    finally:
        await judge.aclose()
    return reply, judged


def test_every_schema_sent_in_the_openai_dialect_passes_strict_mode(server: StrictOpenAIServer) -> None:
    reply, judged = asyncio.run(_send_every_schema(server.url, "openai"))
    # Both calls were answered (an HTTP 400 would raise for the QTM and fall back for the judge).
    assert json.loads(reply.text) == PAPER_EXAMPLE
    assert judged.judge_fallback_reason == "" and judged.judge == "rubric-judge-v1:openai"
    sent = {spec["name"]: spec for spec in (b["response_format"]["json_schema"] for b in server.bodies)}
    assert set(sent) == {"qtm_state", "turn_judgement"}
    for spec in sent.values():
        assert spec["strict"] is True
        assert strict_schema_violations(spec["schema"]) == []


def test_the_llamacpp_dialect_keeps_its_grammar_bounds(server: StrictOpenAIServer) -> None:
    reply, judged = asyncio.run(_send_every_schema(server.url, "llamacpp"))
    assert json.loads(reply.text) == PAPER_EXAMPLE and judged.judge == "rubric-judge-v1:llamacpp"
    schemas = [b["response_format"]["schema"] for b in server.bodies]
    assert schemas == [qtm_json_schema(), rubric_json_schema()]
    # The grammar dialect still bounds the controller's free text; strict mode gets the same schema without.
    assert schemas[0]["properties"]["lens_reason"]["maxLength"] == 200
    assert strict_schema_violations(strict_subset(schemas[0])) == []


@pytest.mark.parametrize("schema", [qtm_json_schema(), rubric_json_schema()], ids=["qtm", "rubric"])
def test_llama_cpp_compiles_each_schema_to_a_grammar(schema: dict[str, Any]) -> None:
    """What llama-cpp-python's server does with `{type: json_object, schema}`: the JSON-schema-to-GBNF
    converter, which must accept the closed objects and name every property."""
    llama_grammar = pytest.importorskip("llama_cpp.llama_grammar")
    gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    assert "root ::=" in gbnf
    for name in schema["properties"]:
        assert f'\\"{name}\\"' in gbnf


def test_the_two_schema_callers_are_all_the_callers() -> None:
    """The test above covers every JsonChatClient user; a new one must be added there."""
    users = {
        str(path.relative_to(SERVICES))
        for path in SERVICES.rglob("*.py")
        if "JsonChatClient(" in path.read_text() and path.name != "llm_json.py"
    }
    assert users == {"mars_state/qtm/controllers.py", "mars_judge/service.py"}


# ---- the checker itself fails on what strict mode rejects ---------------------------------------------


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def test_checker_accepts_a_strict_schema() -> None:
    schema = _closed(
        {
            "n": {"type": "integer", "enum": [0, 1]},
            "x": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
            "inner": _closed({"ok": {"type": "boolean"}}),
            "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        }
    )
    assert strict_schema_violations(schema) == []


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            "additionalProperties",
        ),
        (
            _closed(
                {"inner": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}}
            ),
            "root.inner: an object needs additionalProperties",
        ),
        (
            dict(_closed({"a": {"type": "string"}, "b": {"type": "string"}}), required=["a"]),
            "must be required",
        ),
        (_closed({"a": {"type": "string", "maxLength": 200}}), "'maxLength' is not supported"),
        (_closed({"a": {"type": "string", "format": "uri"}}), "format 'uri'"),
        (_closed({"a": {"type": "integer", "enum": [0, True]}}), "enum value True"),
        (
            _closed(
                {
                    "a": {
                        "type": "object",
                        "properties": {},
                        "required": [],
                        "additionalProperties": False,
                        "patternProperties": {},
                    }
                }
            ),
            "'patternProperties'",
        ),
        (_closed({"a": {"type": "string", "allOf": []}}), "'allOf'"),
        ({"anyOf": [_closed({"a": {"type": "string"}})]}, "root must be an object"),
        (_closed({"a": {"type": "tuple"}}), "type 'tuple'"),
    ],
)
def test_checker_flags_what_strict_mode_rejects(schema: dict[str, Any], problem: str) -> None:
    found = strict_schema_violations(schema)
    assert any(problem in p for p in found), found


def test_checker_flags_depth_and_enum_limits() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(11):
        deep = _closed({"d": deep})
    assert any("deeper than 10" in p for p in strict_schema_violations(deep))
    wide = _closed({"e": {"type": "integer", "enum": list(range(1001))}})
    assert any("enum values" in p for p in strict_schema_violations(wide))


def test_strict_subset_drops_only_string_length_keywords() -> None:
    schema = _closed({"maxLength": {"type": "string", "maxLength": 5, "minLength": 1, "description": "d"}})
    assert strict_subset(schema)["properties"] == {"maxLength": {"type": "string", "description": "d"}}
    assert schema["properties"]["maxLength"]["maxLength"] == 5  # the caller's schema is not modified
