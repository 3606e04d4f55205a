"""What the suite costs: every local stack a test starts is counted and its stop timed, and the summary says how
many there were, how long they took to stop, and which processes had to be killed at a stop (the suite's main
cost: issue 46 asks for fewer and faster). And where the tests run: under pytest-xdist (`make test`), the tests
that start local stacks in order on one worker, the rest beside them."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

#: The tests that start local stacks, share them between adjacent modules (tests/integration/conftest.py) and
#: hold their timing bounds for a machine that runs one stack at a time: one xdist scope, so one worker runs
#: them all, in their order. The unit and chart tests (about 140 s of one core, no stack) run on the other
#: core, which the stacks leave idle about a third of the time.
STACK_TESTS = Path(__file__).parent / "integration"
STACK_GROUP = "local-stacks"
#: Modules there that start what they use in subprocesses, bound no time and run no llama.cpp: free to run
#: beside the stacks, on the other worker. Not the llama.cpp modules (the probe bench, the llama.cpp stages):
#: two llama.cpp servers of two threads each on 2 cores took 2.5 to 7 times as long per call, and a run that
#: let them overlap took 894 s instead of 759.
RUN_BESIDE_STACKS = frozenset({"test_load_short.py"})

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


def _starts_stacks(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return (
        path.startswith(f"{STACK_TESTS.parent.name}/{STACK_TESTS.name}/")
        and Path(path).name not in RUN_BESIDE_STACKS
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-by-scope scheduling with one scope for every test that starts stacks (xdist's own
    `--dist loadgroup` cannot group under this pytest: it renames items through an attribute pytest 9.2 no
    longer reads). A scope runs whole, in order, on one worker; the biggest is sent first."""
    from xdist.scheduler import LoadScopeScheduling

    class StacksOnOneWorker(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return STACK_GROUP if _starts_stacks(nodeid) else str(super()._split_scope(nodeid))

    return StacksOnOneWorker(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand its counts to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["mars_stacks"] = {
            "starts": dict(_STARTS),
            "stop_s": list(_STOP_S),
            "killed": list(_KILLED),
        }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the xdist controller: a worker's counts."""
    counts = getattr(node, "workeroutput", {}).get("mars_stacks")
    if counts:
        _STARTS.update(counts["starts"])
        _STOP_S.extend(counts["stop_s"])
        _KILLED.extend(counts["killed"])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STARTS:
        parts = ", ".join(f"{n} {kind}" for kind, n in sorted(_STARTS.items()))
        terminalreporter.write_line(f"local stacks started: {sum(_STARTS.values())} ({parts})")
    if _STOP_S:
        terminalreporter.write_line(
            f"local stack stops: {len(_STOP_S)}, {sum(_STOP_S):.1f} s in all, longest {max(_STOP_S):.1f} s"
        )
    for line in _KILLED:
        terminalreporter.write_line(f"killed at a stop: {line}")
