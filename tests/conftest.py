"""What the suite costs: every local stack a test starts in this process is counted, and the summary says how
many there were (the suite's main cost: issue 46 asks for fewer)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

_STARTS: Counter[str] = Counter()


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
    start = LocalStack.start

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STARTS[_kind(self)] += 1
        return start(self, *args, **kwargs)

    LocalStack.start = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStack.start = start  # type: ignore[method-assign]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STARTS:
        parts = ", ".join(f"{n} {kind}" for kind, n in sorted(_STARTS.items()))
        terminalreporter.write_line(f"local stacks started in this process: {sum(_STARTS.values())} ({parts})")
