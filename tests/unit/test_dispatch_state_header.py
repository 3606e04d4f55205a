"""Dispatch with MARS_DISPATCH_STATE_HEADER on and off: the chat request a model receives carries the MEMORY GUIDANCE
state header only when it is on (the paper's "No QTM state/header" ablation turns it off)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from mars.model_pool import ModelPool, ModelSpec
from mars.v1 import events_pb2 as ev
from mars_dispatch.clients import ModelClients
from mars_dispatch.dispatcher import Dispatcher
from mars_dispatch.settings import DispatchSettings

STATE = ev.SessionState(action=ev.MATCH, phase=ev.REVISE, query_type=ev.DYNAMIC, lens_recommendation=3)
VIEW = ev.CandidateView(
    blocks=[ev.MemoryBlock(block_id="hist:h1", kind=ev.RETRIEVED_HISTORY, text="We chose Lisbon.", score=2.0)]
)


def _sent_system_prompt(settings: DispatchSettings) -> tuple[str, ev.Generated]:
    spec = ModelSpec(
        name="m",
        base_url="http://model.test/v1",
        context_window=4096,
        output_reserve=64,
        safety_margin=32,
        input_price_per_m=0.0,
        output_price_per_m=0.0,
    )
    pool = ModelPool(models=[spec])
    bodies: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": "Lisbon."}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2},
            },
        )

    async def run() -> ev.Generated:
        clients = ModelClients(pool, retries=0)
        await clients.close()
        clients._clients["m"] = httpx.AsyncClient(
            base_url=spec.base_url, transport=httpx.MockTransport(answer)
        )
        try:
            return await Dispatcher(pool, clients, settings).generate(["m"], "Where to?", STATE, VIEW, 8)
        finally:
            await clients.close()

    out = asyncio.run(run())
    assert out.status == ev.OK and len(bodies) == 1
    messages = bodies[0]["messages"]
    assert isinstance(messages, list) and [m["role"] for m in messages] == ["system", "user"]
    return str(messages[0]["content"]), out


@pytest.mark.parametrize("header", [True, False])
def test_state_header_setting_decides_what_the_model_sees(header: bool) -> None:
    system, out = _sent_system_prompt(DispatchSettings(state_header=header))
    assert system.startswith("SYSTEM RULES") and "We chose Lisbon." in system
    assert ("MEMORY GUIDANCE" in system) is header
    assert ("REVISE" in system) is header and ("continuation of the active thread" in system) is header
    assert list(out.packed_block_ids) == ["hist:h1"]


def test_state_header_is_on_by_default_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DispatchSettings().state_header is True
    monkeypatch.setenv("MARS_DISPATCH_STATE_HEADER", "false")
    assert DispatchSettings().state_header is False
