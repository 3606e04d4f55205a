"""What the suite costs: every local stack a test starts in this process is counted and its stop timed, and the
summary says how many there were, how long they took to stop, and which processes had to be killed at a stop
(the suite's main cost: issue 46 asks for fewer and faster)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import pytest

_STARTS: Counter[str] = Counter()
_STOP_S: list[float] = []
_KILLED: list[str] = []


class _KilledAtStop(logging.Handler):
    """Collects the supervisor's word that a process outlived its stop signal and was killed, while a local
    stack stops (a test of the supervisor's own kill is not one)."""

    stopping = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.stopping and "did not stop" in record.getMessage():
            _KILLED.append(record.getMessage())


def _kind(stack: Any) -> str:
    from mars import topology

    settings = stack.settings
    whole = tuple(settings.services) == topology.NAMES
    return f"{'full' if whole else 'partial'} stack, {settings.llm if settings.start_llm else 'no'} LLM"


@pytest.fixture(scope="session", autouse=True)
def _count_stack_starts() -> Any:
    try:
        from mars_stack.stack import LocalStack
    except ImportError:  # the suite runs without the launcher somewhere: nothing to count
        yield
        return
    start, stop = LocalStack.start, LocalStack.stop

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STARTS[_kind(self)] += 1
        return start(self, *args, **kwargs)

    killed = _KilledAtStop(logging.WARNING)

    def timed(self: Any) -> None:
        began = time.monotonic()
        killed.stopping = True
        try:
            stop(self)
        finally:
            killed.stopping = False
            _STOP_S.append(time.monotonic() - began)

    supervisor_log = logging.getLogger("mars_stack.supervisor")
    supervisor_log.addHandler(killed)
    LocalStack.start = counted  # type: ignore[method-assign]
    LocalStack.stop = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStack.start, LocalStack.stop = start, stop  # type: ignore[method-assign]
        supervisor_log.removeHandler(killed)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STARTS:
        parts = ", ".join(f"{n} {kind}" for kind, n in sorted(_STARTS.items()))
        terminalreporter.write_line(
            f"local stacks started in this process: {sum(_STARTS.values())} ({parts})"
        )
    if _STOP_S:
        terminalreporter.write_line(
            f"local stack stops: {len(_STOP_S)}, {sum(_STOP_S):.1f} s in all, longest {max(_STOP_S):.1f} s"
        )
    for line in _KILLED:
        terminalreporter.write_line(f"killed at a stop: {line}")
