"""What the suite costs: every local stack a test starts is counted and its stop timed, and the summary says how
many there were, how long they took to stop, and which processes had to be killed at a stop (the suite's main
cost: issue 46 asks for fewer and faster). And where the tests run under pytest-xdist (`make test`): which
tests go together, and in which order they are handed out to the workers."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

#: Where the tests run under pytest-xdist (`make test`, 2 workers on 2 cores). Each test module is a scope
#: (xdist runs a scope whole, in order, on one worker), except the modules that share a local stack
#: (tests/integration/conftest.py, shared_stack): those are one scope, in their order. Scopes are handed out
#: in this order: the llama.cpp modules first, then the unit and chart modules, then the other stack modules,
#: the longest first; a worker takes the next scope when it runs out, so both stay busy to the end. Before,
#: one worker ran every stack module in turn (690 s) while the other was done with the rest at 330 s.
STACK_TESTS = Path(__file__).parent / "integration"
#: The modules that run a llama.cpp server (SmolLM2: the shared stack of test_pipeline and
#: test_pipeline_features, and the probe bench's own): one scope, started first, beside the unit tests.
LLAMA_MODULES = (
    "test_llamacpp_stages.py",
    "test_pipeline.py",
    "test_pipeline_features.py",
    "test_probe_qtm_bench.py",
)
#: The other modules that share a stack (conftest.front_door_stack, conftest.standin_stack).
SHARED_STACK_MODULES = (
    ("test_gateway.py", "test_ingress_security.py"),
    ("test_eval.py", "test_feedback.py", "test_replay.py"),
)
#: The longest stack modules (30 to 90 s each on 2 cores), handed out before the rest: a long one last would
#: keep one worker busy while the other has nothing left.
LONGEST_FIRST = (
    "test_gateway.py",
    "test_replay_prefixed.py",
    "test_load_short.py",
    "test_forget_user.py",
    "test_eval.py",
    "test_fuzz.py",
    "test_policy_canary_stack.py",
    "test_metrics_live.py",
)
#: The llama.cpp server's threads in the suite's stacks (mars_stack.settings.LauncherSettings.llm_threads),
#: also for the stacks that CLI runs start. One: its two threads wait for each other, so with a test beside
#: them on 2 cores each call took several times as long (test_llamacpp_stages: 265 s instead of 48).
os.environ.setdefault("MARS_LLM_THREADS", "1")

_STACK_SCOPE = "stacks:"
_LLAMA_SCOPE = f"{_STACK_SCOPE}{LLAMA_MODULES[0]}"


def _stack_module(nodeid: str) -> str | None:
    """The file name of a test in tests/integration, else None."""
    path = nodeid.split("::", 1)[0]
    return Path(path).name if path.startswith(f"{STACK_TESTS.parent.name}/{STACK_TESTS.name}/") else None


def stack_scope(nodeid: str) -> str | None:
    """The xdist scope of a test in tests/integration (its module's, or its shared stack's group), else None."""
    module = _stack_module(nodeid)
    if module is None:
        return None
    if module in LLAMA_MODULES:
        return _LLAMA_SCOPE
    group = next((g for g in SHARED_STACK_MODULES if module in g), (module,))
    return f"{_STACK_SCOPE}{group[0]}"


def _hand_out_rank(scope: str) -> tuple[int, int]:
    if scope == _LLAMA_SCOPE:
        return (0, 0)
    if not scope.startswith(_STACK_SCOPE):
        return (1, 0)
    module = scope.removeprefix(_STACK_SCOPE)
    return (2, LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST))


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-by-scope scheduling with the scopes and order above (xdist's own `--dist loadgroup` cannot
    group under this pytest: it renames items through an attribute pytest 9.2 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class StackScopes(LoadScopeScheduling):  # type: ignore[misc]
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return stack_scope(nodeid) or str(super()._split_scope(nodeid))

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the first hand-out: the queue is complete (a stable sort keeps xdist's order)
                for scope in sorted(self.workqueue, key=_hand_out_rank):
                    self.workqueue.move_to_end(scope)
                self._ordered = True
            super()._assign_work_unit(node)

    return StackScopes(config, log)


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
