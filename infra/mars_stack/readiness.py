"""Free loopback ports, and the polls that wait for a started process to answer on one: what every launcher
here (the local stack, the Kubernetes control plane, Prometheus, a real node) shares."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class StackError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port, never the same one twice in this process (the OS may repeat itself)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_until(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    *,
    every_s: float = 0.1,
    error: type[Exception] = StackError,
) -> Any:
    """Poll `check` until it returns something truthy, and return that. A check that raises counts as not
    ready yet (a server still starting refuses connections, an API server's controllers catch up); the last
    such error goes into the timeout's message. `proc` exiting first, or the timeout, raises `error`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise error(f"{what} exited with code {proc.returncode} while starting\n{tail}")
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # not ready yet: kept for the timeout's message
            last_error = exc
        time.sleep(every_s)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    because = f" (last check failed: {last_error!r})" if last_error is not None else ""
    raise error(f"{what} was not ready after {timeout_s}s{because}\n{tail}")


def tcp_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def grpc_serving(port: int, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
