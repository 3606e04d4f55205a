"""The process shell every service shares: logging, tracing, topics, producer, Postgres, gRPC server with
health and reflection, stage consumers, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from psycopg_pool import AsyncConnectionPool

from mars import data_keys, db, forget, identity, tls, topology
from mars.bus.codec import PoisonEvent, id_problem, is_transient
from mars.bus.consumer import StageConsumer, control_reader
from mars.bus.producer import EventProducer
from mars.bus.topics import ensure_topics
from mars.config import ServiceSettings
from mars.kafka_options import kafka_client_options
from mars.spec import ServiceSpec
from mars.telemetry import setup_telemetry
from mars.v1 import events_pb2 as ev

log = logging.getLogger(__name__)


@dataclass
class GrpcBinding:
    """One gRPC service to serve: the generated `add_*_to_server` function, the servicer, its full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


@dataclass
class ServiceParts:
    bindings: list[GrpcBinding]
    consumers: list[StageConsumer]
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    #: Component health entries beside the services' own (e.g. "mars.v1.Memory.dense": False when degraded).
    health: dict[str, bool] = field(default_factory=dict)
    #: Component health that changes at run time (e.g. "mars.v1.StateEstimator.controller"), polled.
    health_probes: dict[str, Callable[[], bool]] = field(default_factory=dict)
    #: Loops run beside the consumers while serving (e.g. ingress's orphan sweep), cancelled on stop.
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    #: What a replica drops of a forgotten user besides the service's rows, which the runtime deletes
    #: (mars.forget.owner_forgetter) on every service but the ingress (which forgets in ForgetUser).
    on_forgotten: Callable[[ev.UserForgotten], Awaitable[None]] | None = None


@dataclass
class ServiceContext:
    """What a service's `build` function gets to assemble its parts."""

    spec: ServiceSpec
    settings: ServiceSettings
    producer: EventProducer
    pool: AsyncConnectionPool

    @property
    def name(self) -> str:
        return self.spec.name


Builder = Callable[[ServiceContext], Awaitable[ServiceParts]]


class InvalidRequest(ValueError):
    """A request the caller must fix: answered INVALID_ARGUMENT with this message."""


def check_ids(**ids: str) -> None:
    """Raise InvalidRequest for a missing or unusable id (empty, NUL or control characters, too long)."""
    for name, value in ids.items():
        if (problem := id_problem(name, value)) is not None:
            raise InvalidRequest(problem)


class RpcRefusal(Exception):
    """A call that ends with a status for the caller. The message is what the caller sees (short, no
    internals); `detail` is what the log and the records get (defaults to the message); `trailing` goes
    out as trailing metadata (e.g. retry-after-ms)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        detail: str = "",
        trailing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail or message
        self.trailing = trailing


def rpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and a plain message (never a stack trace) for an exception out of an RPC handler."""
    import psycopg

    if isinstance(exc, RpcRefusal):
        return exc.code, str(exc)
    if isinstance(exc, InvalidRequest | PoisonEvent):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, psycopg.DataError | psycopg.errors.ProgramLimitExceeded):
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request holds data the database refuses ({type(exc).__name__})",
        )
    if is_transient(exc):
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"MARS is briefly unavailable ({type(exc).__name__}: its database or broker may be restarting); "
            "retry",
        )
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the request timed out inside the service"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the service log has the details"


_Servicer = TypeVar("_Servicer")
_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")
UnaryMethod = Callable[[_Servicer, _Request, grpc.aio.ServicerContext], Awaitable[_Reply]]


def rpc_errors(method: UnaryMethod[_Servicer, _Request, _Reply]) -> UnaryMethod[_Servicer, _Request, _Reply]:
    """Wrap a unary servicer method: bad input (InvalidRequest, PoisonEvent, data Postgres refuses) is
    INVALID_ARGUMENT, infrastructure trouble UNAVAILABLE, anything else INTERNAL with a plain message; the
    exception is logged here, never sent (grpc's default is UNKNOWN with the exception's text).
    context.abort() passes through."""

    @functools.wraps(method)
    async def guarded(self: _Servicer, request: _Request, context: grpc.aio.ServicerContext) -> _Reply:
        try:
            return await method(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await abort_rpc(context, exc, method.__qualname__)
            raise  # not reached: abort raises

    return guarded


async def abort_rpc(context: grpc.aio.ServicerContext, exc: Exception, where: str) -> NoReturn:
    """End the call with rpc_status's status for `exc` (and a refusal's trailing metadata); the exception
    is logged here, never sent."""
    code, message = rpc_status(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", where)
    elif code == grpc.StatusCode.UNAVAILABLE:
        log.warning("%s: %s: %r", where, code.name, exc)
    else:
        log.info("%s: %s: %s", where, code.name, message)
    trailing = exc.trailing if isinstance(exc, RpcRefusal) else ()
    await context.abort(code, message[:2000], trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


async def serve(spec: ServiceSpec, settings: ServiceSettings, build: Builder) -> None:
    """Serve the service of `spec` with `settings` (an instance of spec.settings) until SIGTERM/SIGINT."""
    name = spec.name
    configure_logging(settings.log_level, name)
    try:
        master = data_keys.master_keys(settings)
    except ValueError as exc:  # found at start, with the variable to fix
        raise SystemExit(f"{name}: {exc}") from exc
    telemetry = setup_telemetry(name, settings)
    ctx = await _open_context(spec, settings, master)
    parts = await build(ctx)
    if forget.acknowledges(name):
        # Every replica reads every control event (a broadcast reader): its service's rows of a forgotten
        # user are deleted and acknowledged, and the replica drops what it caches of them.
        forgetter = forget.owner_forgetter(name, ctx.pool, parts.on_forgotten)
        parts.consumers.append(control_reader(settings, ctx.producer, spec, forgetter))
    grpc_parts = await _start_grpc(spec, settings, parts)
    for consumer in parts.consumers:
        await consumer.start()
    await asyncio.gather(*(c.wait_assigned() for c in parts.consumers))
    await _set_health(grpc_parts.health_servicer, grpc_parts.names, health_pb2.HealthCheckResponse.SERVING)
    for component, ok in parts.health.items():
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        await grpc_parts.health_servicer.set(component, status)
    probes_task = asyncio.create_task(_poll_health(grpc_parts.health_servicer, parts.health_probes))
    background = [asyncio.create_task(loop_fn()) for loop_fn in parts.background]
    log.info(
        "%s serving gRPC on %s:%d with %d consumer(s)",
        name,
        settings.grpc_host,
        grpc_parts.port,
        len(parts.consumers),
    )
    crashed = await _until_stopped(name, parts)

    log.info("%s stopping", name)
    # A stop that hangs (a broker gone while leaving the group, a backlog of spans) must not keep the
    # process alive: after this long it exits hard, and what it did not commit is redelivered.
    watchdog = threading.Timer(STOP_DEADLINE_S, _exit_now, args=(name,))
    watchdog.daemon = True
    watchdog.start()
    probes_task.cancel()
    for task in background:
        task.cancel()
    await _set_health(
        grpc_parts.health_servicer, grpc_parts.names, health_pb2.HealthCheckResponse.NOT_SERVING
    )
    await _stop_in_phases(name, ctx, parts, grpc_parts, telemetry)
    if crashed:
        raise SystemExit(1)


async def _stop_in_phases(
    name: str, ctx: ServiceContext, parts: ServiceParts, grpc_parts: _Serving, telemetry: Any
) -> None:
    """Stop what `serve` started, phase by phase, each timed and logged: a stop that nears the deadline
    says where its time went."""
    # Calls in flight finish before the consumers stop: the ingress's waiting turns get their answers from
    # its consumer, so stopping that first would fail every turn in flight on a rolling update.
    phases: list[tuple[str, float]] = []
    began = time.monotonic()
    await grpc_parts.stop()
    phases.append(("grpc", time.monotonic()))
    if phases[-1][1] - began > 1.0:
        # Calls still open held the stop (up to STOP_GRACE_S): said now, since a stop killed later never
        # logs its phases (seen in full suite runs, not alone).
        log.warning("%s: calls in flight held the gRPC stop for %.1fs", name, phases[-1][1] - began)
    # The consumers stop together: each may wait out its handlers and its last commit, and one after another
    # those waits added up past the supervisor's stop timeout.
    await asyncio.gather(*(consumer.stop() for consumer in parts.consumers))
    phases.append(("consumers", time.monotonic()))
    for hook in parts.on_stop:
        await hook()
    phases.append(("hooks", time.monotonic()))
    await ctx.producer.stop()
    phases.append(("producer", time.monotonic()))
    await ctx.pool.close()
    phases.append(("postgres", time.monotonic()))
    telemetry.shutdown()
    phases.append(("telemetry", time.monotonic()))
    spent, last = [], began
    for phase, at in phases:
        spent.append(f"{phase} {at - last:.2f}")
        last = at
    log.info("%s stopped in %.2fs (%s)", name, last - began, ", ".join(spent))


async def _open_context(spec: ServiceSpec, settings: ServiceSettings, master: Any) -> ServiceContext:
    """Topics ensured, the producer started, Postgres migrated (the spec's migrations), and the data keyring
    when there is a key."""
    name = spec.name
    ensured = await ensure_topics(
        kafka_client_options(settings),
        settings.kafka_partitions,
        settings.topics.all,
        settings.kafka_replication_factor,
    )
    for topic, reason in ensured.failed:  # the consumer or producer on it fails next, with the broker's word
        log.error("%s: topic %s could not be created: %s", name, topic, reason)
    producer = EventProducer(settings, name)
    await producer.start()
    pool = await db.open_pool(settings.postgres_dsn)
    await db.migrate(pool, name, spec.migrations)
    if master is not None:
        producer.keyring = data_keys.Keyring(pool, master, settings.data_key_cache_s)
    else:
        log.warning(
            "%s: no master key (MARS_MASTER_KEY_FILE): turn text travels on Kafka in plaintext, and forgetting "
            "a user cannot make their past events unreadable",
            name,
        )
    return ServiceContext(spec=spec, settings=settings, producer=producer, pool=pool)


@dataclass
class _Serving:
    server: grpc.aio.Server
    #: Health alone, in plaintext, on a port of its own (None without MARS_HEALTH_PORT).
    health_server: grpc.aio.Server | None
    health_servicer: health.aio.HealthServicer
    names: list[str]
    port: int

    async def stop(self) -> None:
        """New calls are refused at once; those in flight get up to STOP_GRACE_S to finish."""
        await self.server.stop(grace=STOP_GRACE_S)
        if self.health_server is not None:
            await self.health_server.stop(None)


async def _start_grpc(spec: ServiceSpec, settings: ServiceSettings, parts: ServiceParts) -> _Serving:
    """The gRPC server (and the health-only one), started NOT_SERVING until the consumers are assigned."""
    server, health_servicer = grpc_server(spec, settings, parts.bindings)
    names = [b.full_name for b in parts.bindings]
    port = tls.add_port(server, f"{settings.grpc_host}:{settings.grpc_port}", settings)
    await server.start()
    # Health alone, in plaintext, on a port of its own: Kubernetes' gRPC probes cannot speak TLS.
    health_server = None
    if settings.health_port:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_server.add_insecure_port(f"{settings.grpc_host}:{settings.health_port}")
        await health_server.start()
    await _set_health(health_servicer, names, health_pb2.HealthCheckResponse.NOT_SERVING)
    return _Serving(server, health_server, health_servicer, names, port)


async def _set_health(servicer: health.aio.HealthServicer, names: Sequence[str], status: Any) -> None:
    for svc in ["", *names]:
        await servicer.set(svc, status)


def _log_tasks(name: str) -> None:
    """SIGUSR1: log every task's await chain, innermost last (a suspended task's own stack shows only its
    outermost frame). The local supervisor asks this (and SIGUSR2's thread stacks) of a stop that outlived
    its timeout before it kills it, so the kill says which await held the stop."""
    for task in asyncio.all_tasks():
        lines = []
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                lines.append(f"  awaiting {coro!r}"[:300])
                break
            lines.append(
                f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}'
            )
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        log.warning("%s: task %s at\n%s", name, task.get_name(), "\n".join(lines))


async def _until_stopped(name: str, parts: ServiceParts) -> bool:
    """Wait for SIGTERM/SIGINT or a consumer that stopped for good; True for the latter (a crash)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _log_tasks, name)
    # SIGUSR2: every thread's stack, written by the interpreter itself, which works when the loop is blocked.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_task = asyncio.create_task(stop.wait())
    watched = [c.task for c in parts.consumers if c.task is not None]
    done, _ = await asyncio.wait([stop_task, *watched], return_when=asyncio.FIRST_COMPLETED)
    crashed = [t for t in done if t is not stop_task]
    if crashed:
        # A consumer that stopped for good must take the process down, so an orchestrator restarts it.
        log.error("%s: a consumer stopped unexpectedly: %r", name, crashed[0].exception())
    return bool(crashed)


STOP_DEADLINE_S = 20.0
#: How long calls in flight may take to finish once a stop began (a turn under load takes seconds); within
#: STOP_DEADLINE_S, which the chart's terminationGracePeriodSeconds exceeds.
STOP_GRACE_S = 12.0


def grpc_server(
    spec: ServiceSpec, settings: ServiceSettings, bindings: Sequence[GrpcBinding]
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The service's gRPC server with health, its bindings, the identity check on internal RPCs (the
    spec's permissions), and reflection where the API is public (the ingress) or a setting asks for it."""
    name = spec.name
    verifier = None
    if settings.identity_ca_file:
        try:
            verifier = identity.IdentityVerifier.from_file(settings.identity_ca_file, settings.identity_scope)
        except identity.IdentityConfigError as exc:
            raise SystemExit(f"{name}: {exc}") from exc
    names = [b.full_name for b in bindings]
    internal = [n for n in names if spec.internal and n == spec.grpc_service]
    if internal and not settings.identity_required:
        log.warning("%s: MARS_IDENTITY_REQUIRED=false: any caller that reaches the port may call it", name)
    elif internal and verifier is None:
        log.warning("%s: no MARS_IDENTITY_CA_FILE: every call to %s is refused", name, ", ".join(internal))
    options: list[tuple[str, int]] = []
    if settings.grpc_max_connection_age_s > 0:
        age_ms = int(settings.grpc_max_connection_age_s * 1000)
        # A connection's calls in flight may finish after its GOAWAY: the longest call the service allows
        # (the ingress: a turn's timeout), at least STOP_GRACE_S. The GOAWAY only moves new calls to a new
        # connection; a stop still bounds the calls in flight by STOP_GRACE_S.
        options += [
            ("grpc.max_connection_age_ms", age_ms),
            ("grpc.max_connection_age_grace_ms", int(connection_age_grace_s(settings) * 1000)),
        ]
    server = grpc.aio.server(
        interceptors=[
            identity.IdentityInterceptor(verifier, spec.method_permissions, settings.identity_required)
        ],
        options=options,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    if settings.grpc_reflection or len(internal) < len(names):
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, health_servicer


def connection_age_grace_s(settings: ServiceSettings) -> float:
    """How long a connection's calls in flight go on after its max-age GOAWAY."""
    return max(STOP_GRACE_S, settings.longest_call_s())


def _exit_now(name: str) -> None:
    log.error("%s: stopping took over %.0fs; exiting now", name, STOP_DEADLINE_S)
    logging.shutdown()
    os._exit(1)


async def _poll_health(
    servicer: health.aio.HealthServicer, probes: dict[str, Callable[[], bool]], every_s: float = 1.0
) -> None:
    last: dict[str, bool] = {}
    while probes:
        for component, probe in probes.items():
            try:
                ok = bool(probe())
            except Exception as exc:
                ok = False
                if last.get(component, True):  # logged when it turns, not every second
                    log.warning("health probe %s failed: %r", component, exc)
            if last.get(component) != ok:
                last[component] = ok
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ok
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                await servicer.set(component, status)
        await asyncio.sleep(every_s)


def service_settings(spec: ServiceSpec) -> ServiceSettings:
    """The service's settings from its environment (spec.settings): a misspelt MARS_* name stops it here,
    naming the one it meant, not as a silent default. The names every other deployable reads may be there
    too (one env file for the stack): those come from every spec (mars.topology)."""
    try:
        spec.settings.check_environment(elsewhere=topology.deployable_env_names())
    except ValueError as exc:
        raise SystemExit(f"{spec.name}: {exc}") from None
    return spec.settings()


def run(spec: ServiceSpec, build: Builder) -> None:
    """The one entry of every service process: its settings, checked, then `serve` until stopped."""
    settings = service_settings(spec)
    if settings.uvloop:
        import uvloop

        uvloop.run(serve(spec, settings, build))
    else:
        asyncio.run(serve(spec, settings, build))
