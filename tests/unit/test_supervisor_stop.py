"""A stop that hangs: the supervisor kills it after its timeout, and its warning carries where the process was
(a MARS service logs every task's stack on SIGUSR1: mars.runtime._log_tasks), so a suite's summary says what
held a stop instead of only that one was held."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import pytest
from mars_stack.supervisor import Supervisor

#: An asyncio process that ignores SIGTERM (its stop hangs in `hold_the_stop`) and logs its tasks on SIGUSR1
#: with the service runtime's own handler.
HANGING = """
import asyncio, logging, signal, sys
from mars import runtime

logging.basicConfig(level=logging.INFO, stream=sys.stdout)

async def hold_the_stop():
    await asyncio.Event().wait()

async def main():
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    loop.add_signal_handler(signal.SIGUSR1, runtime._log_tasks, "hanging")
    task = asyncio.create_task(hold_the_stop(), name="the-held-stop")
    print("ready stopping", flush=True)
    await task

asyncio.run(main())
"""


def test_a_hanging_stop_is_killed_and_the_warning_says_which_await_held_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    supervisor = Supervisor(tmp_path)
    proc = supervisor.spawn("hanging", [sys.executable, "-c", HANGING], dump_signals=(signal.SIGUSR1,))
    deadline = time.monotonic() + 30
    while "ready" not in proc.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="mars_stack.supervisor"):
        supervisor._terminate_all([proc], timeout_s=1.0)
    assert proc.popen.returncode == -signal.SIGKILL
    [warning] = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
    assert "the-held-stop" in warning and "hold_the_stop" in warning, warning
