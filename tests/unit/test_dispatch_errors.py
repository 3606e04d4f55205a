"""Dispatch against a real local HTTP server that misbehaves: a 200 whose body is not a chat completion
falls back to the next arm; a half-open trial is always resolved (a bad answer re-opens the circuit with a
fresh pause, a cancelled caller frees the trial); a call cut by the turn's own deadline is not held
against the arm's circuit, while the endpoint's own timeout and errors are."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from mars.domain.circuit import CircuitBreaker
from mars.model_pool import ModelPool, ModelSpec
from mars.v1 import events_pb2 as ev
from mars_dispatch.clients import ModelClients
from mars_dispatch.dispatcher import Dispatcher
from mars_dispatch.settings import DispatchSettings

RESET_S = 30.0
_GOOD = json.dumps(
    {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Lisbon."}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2},
    }
)


class MisbehavingServer:
    """HTTP/1.1 keep-alive server on 127.0.0.1: arm `name` posts to /name/v1/chat/completions and gets
    what `script[name]` says next ("ok", "503", "hang", or any other text: a 200 with that body). The last
    entry of a script repeats."""

    def __init__(self) -> None:
        self.script: dict[str, list[str]] = {}
        self.calls: Counter[str] = Counter()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> MisbehavingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def spec(self, name: str, timeout_s: float = 30.0) -> ModelSpec:
        return ModelSpec(
            name=name,
            base_url=f"http://127.0.0.1:{self.port}/{name}/v1",
            context_window=4096,
            output_reserve=64,
            safety_margin=32,
            input_price_per_m=1.0,
            output_price_per_m=1.0,
            timeout_s=timeout_s,
        )

    def _next(self, name: str) -> str:
        steps = self.script[name]
        return steps.pop(0) if len(steps) > 1 else steps[0]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                name = lines[0].split()[1].strip("/").split("/")[0]
                length = next(
                    (
                        int(v)
                        for k, _, v in (ln.partition(":") for ln in lines)
                        if k.lower() == "content-length"
                    ),
                    0,
                )
                await reader.readexactly(length)
                self.calls[name] += 1
                step = self._next(name)
                if step == "hang":
                    await asyncio.sleep(3600)
                status, body = {
                    "ok": ("200 OK", _GOOD),
                    "503": ("503 Service Unavailable", "overloaded"),
                }.get(step, ("200 OK", step))
                data = body.encode()
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()


class Clock:
    """The circuit breakers' clock, moved by hand: pauses pass at once and exactly, whatever the load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


Make = Callable[..., Dispatcher]
Scenario = Callable[[MisbehavingServer, Make, Clock], Awaitable[Any]]


def _run(scenario: Scenario) -> Any:
    """Runs `scenario(server, make_dispatcher, clock)`; make_dispatcher(specs, retries) builds the real
    Dispatcher over real ModelClients, its circuits on `clock` (threshold 1: a single counted failure
    opens a circuit)."""

    async def main() -> Any:
        clients: list[ModelClients] = []
        clock = Clock()

        def make(specs: list[ModelSpec], retries: int = 0) -> Dispatcher:
            pool = ModelPool(models=specs)
            clients.append(ModelClients(pool, retries=retries))
            settings = DispatchSettings(circuit_failure_threshold=1, circuit_reset_s=RESET_S)
            dispatcher = Dispatcher(pool, clients[-1], settings)
            for name, breaker in dispatcher.breakers.items():
                dispatcher.breakers[name] = CircuitBreaker(
                    breaker.failure_threshold, breaker.reset_after_s, clock=clock
                )
            return dispatcher

        async with MisbehavingServer() as server:
            try:
                return await scenario(server, make, clock)
            finally:
                for c in clients:
                    await c.close()

    return asyncio.run(main())


async def _ask(
    dispatcher: Dispatcher, arms: list[str], deadline_in_s: float | None = None, stream: bool = False
) -> ev.Generated:
    deadline_ms = int((time.time() + deadline_in_s) * 1000) if deadline_in_s is not None else 0

    async def on_delta(arm: str, piece: str, restart: bool) -> None:
        pass

    return await dispatcher.generate(
        arms,
        "Where to?",
        ev.SessionState(),
        ev.CandidateView(),
        8,
        on_delta=on_delta if stream else None,
        deadline_ms=deadline_ms,
    )


def test_a_200_whose_body_is_not_json_falls_back_to_the_next_arm() -> None:
    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"bad": ["<html>upstream busy</html>"], "good": ["ok"]}
        d = make([server.spec("bad"), server.spec("good")], 1)
        out = await _ask(d, ["bad", "good"])
        assert out.status == ev.OK and out.model == "good" and out.text == "Lisbon."
        assert [a.arm for a in out.attempts] == ["bad", "good"] and not out.attempts[0].ok
        assert "not JSON" in out.attempts[0].error
        assert out.attempts[0].outcome == "endpoint_error" and out.attempts[1].outcome == "ok"
        assert "upstream busy" not in out.attempts[0].error  # the body is the log's, never the event's
        assert server.calls["bad"] == 1  # a well-formed HTTP answer with a bad body is not retried
        assert d.breakers["bad"].state == "open"  # it is the endpoint's failure

    _run(scenario)


@pytest.mark.parametrize(
    "body",
    ["[1, 2]", '{"choices": []}', '{"choices": [{"message": {"content": ["a", "list"]}}]}'],
)
def test_json_that_is_not_a_chat_completion_falls_back_too(body: str) -> None:
    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"bad": [body], "good": ["ok"]}
        out = await _ask(make([server.spec("bad"), server.spec("good")]), ["bad", "good"])
        assert out.model == "good" and "malformed completion" in out.attempts[0].error

    _run(scenario)


def test_usage_that_is_not_a_count_is_estimated_not_fatal() -> None:
    body = '{"choices": [{"message": {"content": "Lisbon."}}], "usage": {"prompt_tokens": "many"}}'

    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": [body]}
        out = await _ask(make([server.spec("m")]), ["m"])
        assert out.status == ev.OK and out.text == "Lisbon." and out.usage.estimated

    _run(scenario)


def test_a_half_open_trial_answered_with_a_bad_body_reopens_for_a_fresh_pause() -> None:
    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": ["503", "not json at all", "ok"]}
        d = make([server.spec("m")])
        breaker = d.breakers["m"]
        assert (await _ask(d, ["m"])).status == ev.FAILED and breaker.state == "open"
        clock.now += RESET_S  # the pause is over
        trial = await _ask(d, ["m"])  # the half-open trial gets a 200 that is not JSON
        assert trial.status == ev.FAILED and "not JSON" in trial.attempts[0].error
        assert breaker.state == "open"  # re-opened, and the pause starts again from the trial
        fast = await _ask(d, ["m"])
        assert "circuit open for m" in fast.attempts[0].error and server.calls["m"] == 2
        clock.now += RESET_S - 1
        assert breaker.state == "open"  # a full pause counted from the failed trial...
        clock.now += 1
        assert breaker.state == "half_open"  # ...and only then the next trial
        healed = await _ask(d, ["m"])
        assert healed.status == ev.OK and breaker.state == "closed"

    _run(scenario)


def test_a_cancelled_half_open_trial_frees_the_trial_for_the_next_call() -> None:
    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": ["503", "hang", "ok"]}
        d = make([server.spec("m")])
        await _ask(d, ["m"])
        clock.now += RESET_S  # the pause is over
        trial = asyncio.create_task(_ask(d, ["m"]))
        while server.calls["m"] < 2:  # the trial reached the endpoint, which hangs
            await asyncio.sleep(0.01)
        trial.cancel()  # the caller goes away (e.g. its gRPC call was cancelled)
        with pytest.raises(asyncio.CancelledError):
            await trial
        assert d.breakers["m"].state == "half_open"
        again = await _ask(d, ["m"])  # the next call is the trial now
        assert again.status == ev.OK and d.breakers["m"].state == "closed"

    _run(scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_the_turns_own_deadline_does_not_count_against_the_arm(stream: bool) -> None:
    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": ["hang", "hang", "hang", "ok"]}
        d = make([server.spec("m", timeout_s=30.0)])
        for _ in range(3):  # one impatient client, over and over
            cut = await _ask(d, ["m"], deadline_in_s=0.15, stream=stream)
            assert cut.status == ev.FAILED and "before the turn's deadline" in cut.attempts[0].error
            assert cut.attempts[0].latency_ms < 10_000  # cut at the deadline, not the 30 s endpoint timeout
            assert d.breakers["m"].state == "closed"
        assert (await _ask(d, ["m"])).status == ev.OK  # another tenant's turn still goes through

    _run(scenario)


def test_a_half_open_trial_cut_by_the_turns_deadline_leaves_the_circuit_half_open() -> None:
    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": ["503", "hang", "ok"]}
        d = make([server.spec("m")])
        await _ask(d, ["m"])
        clock.now += RESET_S  # the pause is over
        cut = await _ask(d, ["m"], deadline_in_s=0.15)
        assert "before the turn's deadline" in cut.attempts[0].error
        assert d.breakers["m"].state == "half_open"  # no verdict on the endpoint: not re-opened
        assert (await _ask(d, ["m"])).status == ev.OK and d.breakers["m"].state == "closed"

    _run(scenario)


def test_the_endpoints_own_timeout_still_counts() -> None:
    """Guard: the endpoint's own timeout (its timeout_s in the pool) is its failure, deadline or not."""

    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": ["hang"]}
        d = make([server.spec("m", timeout_s=0.15)])
        out = await _ask(d, ["m"], deadline_in_s=10.0)
        assert "Timeout" in out.attempts[0].error and d.breakers["m"].state == "open"

    _run(scenario)


def test_an_endpoint_error_before_the_deadline_cut_still_counts() -> None:
    """Guard: a 503 on the first attempt, then the retry is cut by the deadline: the endpoint did fail."""

    async def scenario(server: MisbehavingServer, make: Make, clock: Clock) -> None:
        server.script = {"m": ["503", "hang"]}
        d = make([server.spec("m")], 1)
        out = await _ask(d, ["m"], deadline_in_s=0.6)
        assert server.calls["m"] == 2
        error = out.attempts[0].error
        assert "before the turn's deadline" in error and "HTTP 503" in error
        assert "overloaded" not in error  # the 503's body stays out of the event
        assert d.breakers["m"].state == "open"

    _run(scenario)
