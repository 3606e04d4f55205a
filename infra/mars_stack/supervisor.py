"""The local stack's processes, supervised like a kubelet supervises containers: a process that dies is
started again with the same command, environment and data (backoff 0.5 s doubling to 15 s, reset after a
minute up); only `stop_all` ends them. The chaos tools' kill, pause and restart go through here too."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Restart backoff: first wait, cap, and how long a process must have been up for the wait to reset.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 15.0
BACKOFF_RESET_S = 60.0

log = logging.getLogger(__name__)


@dataclass
class Proc:
    """One supervised process: `name` is unique ("memory-2"), `service` the program it runs."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    spawn_kw: dict[str, Any] = field(default_factory=dict)
    service: str = ""
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    #: When the supervisor will start it again (monotonic), None while it runs.
    restart_at: float | None = None
    #: Stopped on purpose (stop_process): the supervisor leaves it down.
    held: bool = False
    #: What asks it to stop (Postgres: SIGINT, its fast shutdown; SIGTERM would wait for its clients).
    stop_signal: int = signal.SIGTERM
    #: Run before each start again (Postgres as root: reopen the folders above its data).
    before_restart: Callable[[], None] | None = None
    #: What makes it log where it is (a MARS service: SIGUSR1, every task's stack; SIGUSR2, every thread's),
    #: sent before a stop that outlived its timeout is killed, so the kill says what held it.
    dump_signals: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProcEvent:
    """What the supervisor saw: a process exited (with its code) or was started again."""

    at: float
    name: str
    kind: str  # "exited" | "restarted"
    detail: str


class Supervisor:
    """Starts processes with their output in `logdir/<name>.log`, and (after `watch`) restarts the ones
    that die. `procs` and `events` are the stack's own lists (the CLI and the harnesses read them)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[Proc] = []
        self.events: list[ProcEvent] = []
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def spawn(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        service: str = "",
        *,
        stop_signal: int = signal.SIGTERM,
        before_restart: Callable[[], None] | None = None,
        dump_signals: tuple[int, ...] = (),
        **kw: Any,
    ) -> Proc:
        """Start `cmd` in a session of its own (`kw` goes to Popen, e.g. `user`)."""
        log = self.logdir / f"{name}.log"
        fh = log.open("ab")
        env = env or os.environ.copy()
        popen = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            **kw,
        )
        fh.close()
        proc = Proc(
            name,
            popen,
            log,
            cmd=cmd,
            env=env,
            spawn_kw=kw,
            service=service or name,
            stop_signal=stop_signal,
            before_restart=before_restart,
            dump_signals=dump_signals,
        )
        with self._lock:
            self.procs.append(proc)
        return proc

    def watch(self) -> None:
        """Restart what dies from now on, on a thread of its own, until `stop_all`."""
        self._watcher = threading.Thread(target=self._supervise, name="mars-stack-supervisor", daemon=True)
        self._watcher.start()

    def stop_all(self, last: frozenset[str]) -> None:
        """Stop supervising, then every process: all but `last` at once, then `last` at once (the services
        drain and commit while the infrastructure they use is still up)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            self._terminate_all([p for p in self.procs if p.name not in last])
            self._terminate_all([p for p in self.procs if p.name in last])
            self.procs.clear()

    # --- restarts ---------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                for proc in self.procs:
                    self._check(proc)

    def _check(self, proc: Proc) -> None:
        now = time.monotonic()
        if proc.held:
            return
        if proc.restart_at is None:
            code = proc.popen.poll()
            if code is None:
                return
            up = now - proc.started_at
            if up >= BACKOFF_RESET_S:
                proc.restarts = 0
            wait = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (2**proc.restarts))
            proc.restart_at = now + wait
            event = ProcEvent(time.time(), proc.name, "exited", f"code {code} after {up:.1f}s up")
            self.events.append(event)
            with (self.logdir / f"{proc.name}.log").open("a") as fh:
                fh.write(
                    f"\n--- mars-stack: {proc.name} exited ({event.detail}); restart in {wait:.1f}s ---\n"
                )
        elif now >= proc.restart_at:
            proc.restarts += 1
            try:
                self._respawn(proc)
            except Exception as exc:  # e.g. a fork failure: try again later, never stop supervising
                proc.restart_at = now + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (2**proc.restarts))
                self.events.append(ProcEvent(time.time(), proc.name, "exited", f"could not start: {exc!r}"))
                return
            self.events.append(ProcEvent(time.time(), proc.name, "restarted", f"restart #{proc.restarts}"))

    def _respawn(self, proc: Proc) -> None:
        if proc.before_restart is not None:
            proc.before_restart()
        fh = (self.logdir / f"{proc.name}.log").open("ab")
        fh.write(f"\n--- mars-stack: starting {proc.name} again ---\n".encode())
        fh.flush()
        try:
            proc.popen = subprocess.Popen(
                proc.cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=proc.env,
                start_new_session=True,
                **proc.spawn_kw,
            )
        finally:
            fh.close()
        proc.started_at = time.monotonic()
        proc.restart_at = None

    def _terminate_all(self, procs: list[Proc], timeout_s: float = 15.0) -> None:
        """Stop processes at once: every stop signal sent, then every exit awaited; what outlives
        `timeout_s` is killed."""
        running = [p for p in procs if p.popen.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.popen.pid, signal.SIGCONT)  # a paused process cannot handle its stop signal
                proc.popen.send_signal(proc.stop_signal)
        deadline = time.monotonic() + timeout_s
        for proc in running:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Worth knowing: a stop that never ends costs every stack's teardown the whole timeout. What
                # held it is in the log's last lines, after the process is asked where it is.
                where = self._where(proc)
                log.warning(
                    "%s did not stop within %.0f s of its stop signal: killed; its log's end:\n%s",
                    proc.name,
                    timeout_s,
                    where,
                )
                proc.popen.kill()
                proc.popen.wait()

    @staticmethod
    def _where(proc: Proc, lines: int = 200) -> str:
        """The process's log from its last "stopping" line on (at most `lines`), after its dump signals (if it
        has any) had a moment to add where it is."""
        for sig in proc.dump_signals:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(sig)
            time.sleep(0.5)
        try:
            text = proc.log.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        begun = max((i for i, line in enumerate(text) if line.rstrip().endswith(" stopping")), default=0)
        return "\n".join(text[begun:][-lines:])

    # --- chaos: what the tools and tests do to a process ------------------------------------------

    def proc(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r}; have {', '.join(p.name for p in self.procs)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a process (SIGKILL: a crash; the supervisor starts it again)."""
        with self._lock:
            self.proc(name).popen.send_signal(sig)

    def restart(self, name: str) -> None:
        """A clean restart (e.g. a Postgres restart): stop it gracefully, then start it at once."""
        with self._lock:
            proc = self.proc(name)
            proc.held = True
        try:
            self._terminate_all([proc])
            with self._lock:
                self._respawn(proc)
                self.events.append(ProcEvent(time.time(), name, "restarted", "on request"))
        finally:
            proc.held = False

    def alive(self) -> Iterator[tuple[str, bool]]:
        for p in self.procs:
            yield p.name, p.popen.poll() is None
