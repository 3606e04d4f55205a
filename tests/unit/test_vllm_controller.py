"""The in-process vLLM QTM backend drives its engine one call at a time, with a cap on calls in flight.

vllm itself cannot be installed here, so a fake engine stands in for `vllm.LLM`: it records how many
`generate` calls are inside it at once, and can be held at a gate to play a slow or stuck generation.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mars.v1 import events_pb2 as ev
from mars_state.qtm.controllers import ControllerUnavailable, VllmController, make_controller
from mars_state.qtm.guard import GuardedEstimator
from mars_state.qtm.prompts import PromptTemplate
from mars_state.qtm.serial_engine import EngineBusy, SerialEngine

PAPER_EXAMPLE = json.loads((Path(__file__).parent / "fixtures" / "qtm_paper_example.json").read_text())


class FakeTokenizer:
    def apply_chat_template(
        self, messages: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert not tokenize and add_generation_prompt
        return "\n".join(m["content"] for m in messages)


@dataclass
class FakeCompletion:
    text: str
    token_ids: list[int]


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]


@dataclass
class FakeEngine:
    """Stands in for vllm.LLM; `gate` (when set up) holds every generate until it is opened."""

    answer: str = json.dumps(PAPER_EXAMPLE)
    hold_s: float = 0.0
    gate: threading.Event | None = None
    fail: bool = False
    prompts: list[str] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    def generate(
        self, prompts: list[str], sampling_params: Any, *, use_tqdm: bool
    ) -> list[FakeRequestOutput]:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.prompts.append(prompts[0])
        try:
            if self.gate is not None:
                assert self.gate.wait(10.0), "test gate never opened"
            time.sleep(self.hold_s)
            if self.fail:
                raise RuntimeError("CUDA error: out of memory")
            return [FakeRequestOutput(list(range(700)), [FakeCompletion(self.answer, list(range(120)))])]
        finally:
            with self._lock:
                self.active -= 1


def controller(engine: FakeEngine, max_in_flight: int = 4) -> VllmController:
    return VllmController(
        engine, sampling_params=None, prompt=PromptTemplate.load("qtm-v1"), max_in_flight=max_in_flight
    )


async def settled(c: VllmController) -> None:
    """Wait until every admitted call has left the engine (releases come from the worker thread)."""
    for _ in range(500):
        if c.in_flight == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{c.in_flight} calls still in flight")


async def test_concurrent_calls_run_one_generate_at_a_time() -> None:
    engine = FakeEngine(hold_s=0.02)
    c = controller(engine, max_in_flight=8)
    replies = await asyncio.gather(*(c.call(f"turn {i}", ["write a poem"]) for i in range(6)))
    assert engine.max_active == 1 and len(engine.prompts) == 6
    assert all(json.loads(r.text) == PAPER_EXAMPLE for r in replies)
    first = replies[0]
    assert (first.input_tokens, first.output_tokens, first.usage_estimated) == (700, 120, False)
    await c.aclose()


async def test_a_call_cancelled_at_its_deadline_does_not_overlap_the_next() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    c = controller(engine)
    guard = GuardedEstimator(c, deadline_s=0.05)
    late = await guard.estimate("make it shorter", ["write a poem"])
    assert late.usage.fallback_reason == "deadline"
    # The abandoned generate is still running in the engine and still counts as in flight.
    assert engine.active == 1 and c.in_flight == 1
    asyncio.get_running_loop().call_later(0.1, gate.set)
    guard.deadline_s = 5.0
    st = await guard.estimate("and the second verse?", ["write a poem"])
    assert not st.usage.fallback_reason and st.usage.backend == "vllm" and st.phase == ev.REVISE
    assert engine.max_active == 1 and len(engine.prompts) == 2
    await settled(c)
    await c.aclose()


async def test_a_queued_call_abandoned_before_it_started_never_reaches_the_engine() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    c = controller(engine)
    running = asyncio.create_task(c.call("first", []))
    await asyncio.sleep(0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(c.call("abandoned", []), 0.05)
    gate.set()
    await running
    await settled(c)
    assert len(engine.prompts) == 1 and "first" in engine.prompts[0]
    await c.aclose()


async def test_calls_past_the_cap_fail_fast_and_the_guard_falls_back() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    c = controller(engine, max_in_flight=2)
    admitted = [asyncio.create_task(c.call(f"turn {i}", [])) for i in range(2)]
    await asyncio.sleep(0.05)
    assert c.in_flight == 2
    started = time.perf_counter()
    with pytest.raises(EngineBusy) as busy:
        await c.call("one too many", [])
    assert isinstance(busy.value, ControllerUnavailable) and "cap 2" in str(busy.value)
    st = await GuardedEstimator(c, deadline_s=5.0).estimate("When did I book the flight?", [])
    assert time.perf_counter() - started < 1.0  # rejected at once, not queued behind the stuck engine
    assert st.usage.fallback_reason == "endpoint_error" and st.query_type == ev.TEMPORAL
    gate.set()
    await asyncio.gather(*admitted)
    await settled(c)
    assert len(engine.prompts) == 2 and engine.max_active == 1
    assert (await c.call("room again", [])).text  # admitted once the engine drained
    await c.aclose()


async def test_an_engine_error_is_an_endpoint_error() -> None:
    c = controller(FakeEngine(fail=True))
    with pytest.raises(ControllerUnavailable, match="out of memory"):
        await c.call("make it shorter", ["write a poem"])
    st = await GuardedEstimator(c).estimate("make it shorter", ["write a poem"])
    assert st.usage.fallback_reason == "endpoint_error" and st.phase == ev.REVISE
    await settled(c)
    await c.aclose()
    with pytest.raises(ControllerUnavailable, match="closed"):
        await c.call("after close", [])


def test_serial_engine_needs_a_positive_cap() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SerialEngine(0)


def test_vllm_backend_without_vllm_says_how_to_get_it() -> None:
    with pytest.raises(ValueError, match="MARS_STATE_QTM_MODEL"):
        make_controller("vllm")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install vllm"):
            make_controller("vllm", model="/models/qwen2.5-7b-instruct")
    else:
        pytest.skip(
            "checks the message shown where vllm is absent; vllm is installed here (a GPU node), where "
            "make_controller would load a real model, which is tests/gpu's job, not a unit test's"
        )
