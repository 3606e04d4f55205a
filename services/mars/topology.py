"""The deployment's topology: every deployable's spec (mars.spec), gathered for what needs them all.

Each deployable package defines its own spec (`mars_<name>.spec.SPEC`: settings class, migrations, groups,
topics, permissions) and declares it in the `mars.deployables` entry points (pyproject.toml); this registry
loads them, through importlib.metadata, the first time one is asked for. So the library imports no service
(.importlinter's layers hold), and the one list of deployables is the package's own metadata: an install
that lacks it (an editable install from before the table, a tree on PYTHONPATH alone) fails loudly here,
naming the fix.

The local launcher (mars_stack), `mars migrate`, the replay presets, the chaos harness, `mars deploy status`,
Kafka ACLs, Postgres roles and the chart tests (KEDA triggers) read every spec here; a running service reads
only its own (mars.runtime.run). Group and topic names are before the run's topic prefix.

The module's tables (SERVICES, NAMES, GATEWAY, STAGE_GROUPS, PERMISSIONS, INTERNAL_SERVICES) are attributes
computed on first use (the module's __getattr__), so importing it loads nothing.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mars.config import CallerSettings, env_name
from mars.spec import ConsumerGroup, GatewaySpec, ServiceSpec

#: The entry-point group each deployable's spec is declared in ([project.entry-points."mars.deployables"]).
ENTRY_POINTS = "mars.deployables"
#: The order the local stack starts the services in (the pipeline's, the ingress last: it serves once the
#: stages behind it are up). A service not listed comes after these, by name.
START_ORDER = ("state", "memory", "router", "dispatch", "judge", "ingress")


class TopologyError(RuntimeError):
    """The deployables' specs cannot be found or do not fit together."""


@dataclass(frozen=True)
class Deployables:
    """Every spec the entry points declare: the stage services in start order, and the gateway."""

    services: tuple[ServiceSpec, ...]
    gateway: GatewaySpec


def _load_entry_points() -> list[tuple[str, Any]]:
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINTS)
    if not entry_points:
        raise TopologyError(
            f"no deployables: no installed distribution declares the {ENTRY_POINTS!r} entry points "
            "(pyproject.toml's [project.entry-points.\"mars.deployables\"]); reinstall the project "
            "(`make install`, or `pip install -e .`) so its metadata has them"
        )
    return [(ep.name, ep.load()) for ep in entry_points]


@functools.cache
def deployables() -> Deployables:
    """The specs, loaded once from the `mars.deployables` entry points."""
    found: dict[str, ServiceSpec | GatewaySpec] = {}
    for name, spec in _load_entry_points():
        if not isinstance(spec, ServiceSpec | GatewaySpec) or spec.name != name:
            raise TopologyError(f"entry point {ENTRY_POINTS}:{name} is {spec!r}, not the spec of {name!r}")
        # The same spec declared twice (two installs of the project on the path) is one deployable.
        if found.setdefault(name, spec) is not spec:
            raise TopologyError(f"two different specs are declared for the deployable {name!r}")
    services = {n: s for n, s in found.items() if isinstance(s, ServiceSpec)}
    gateways = [s for s in found.values() if isinstance(s, GatewaySpec)]
    if len(gateways) != 1:
        raise TopologyError(f"expected one gateway among the {ENTRY_POINTS!r} entry points, got {len(gateways)}")
    groups = [g.name for s in services.values() for g in s.groups]
    if len(groups) != len(set(groups)):
        raise TopologyError(f"a consumer group is declared twice: {sorted(groups)}")

    def rank(name: str) -> tuple[int, str]:
        return (START_ORDER.index(name) if name in START_ORDER else len(START_ORDER), name)

    return Deployables(tuple(services[n] for n in sorted(services, key=rank)), gateways[0])


def service(name: str) -> ServiceSpec:
    by_name = {s.name: s for s in deployables().services}
    try:
        return by_name[name]
    except KeyError:
        raise ValueError(f"unknown service {name!r}; known: {', '.join(by_name)}") from None


def group(name: str) -> ConsumerGroup:
    groups = {g.name: g for s in deployables().services for g in s.groups}
    try:
        return groups[name]
    except KeyError:
        raise ValueError(f"unknown consumer group {name!r}; known: {', '.join(groups)}") from None


def deployable_settings() -> dict[str, type[CallerSettings]]:
    """Every deployable's settings model by name: the services' and the gateway's."""
    found = deployables()
    return {**{s.name: s.settings for s in found.services}, found.gateway.name: found.gateway.settings}


def deployable_env_names() -> frozenset[str]:
    """Every MARS_* name some deployable reads, old names included: what a deployable's environment may
    carry for another (mars.config.CallerSettings.check_environment)."""
    return frozenset(n for cls in deployable_settings().values() for n in cls.env_names())


def field_env(field_name: str, value: str) -> dict[str, str]:
    """The environment that sets `field_name` to `value` in every deployable whose model has the field, each
    under its own name (mars.config.env_name): e.g. model_pool for the router, dispatch and the gateway."""
    return {
        env_name(cls, field_name): value
        for cls in deployable_settings().values()
        if field_name in cls.model_fields
    }


def _tables() -> dict[str, Any]:
    services = deployables().services
    return {
        #: Every service, in the order the local stack starts them.
        "SERVICES": services,
        "NAMES": tuple(s.name for s in services),
        #: The HTTP gateway: a deployable too, a caller of the ingress with no stage of its own.
        "GATEWAY": deployables().gateway,
        #: Every stage group, by service in start order. (Each ingress replica's reply reader is a broadcast
        #: reader with no group and no lag to scale on.)
        "STAGE_GROUPS": tuple(g for s in services for g in s.groups),
        #: Who may call what, by full gRPC method name; a method missing here is refused to everyone.
        "PERMISSIONS": _permissions(services),
        #: The stage services: every RPC on them needs a caller identity (health and reflection aside).
        "INTERNAL_SERVICES": frozenset(s.grpc_service for s in services if s.internal),
    }


def _permissions(services: tuple[ServiceSpec, ...]) -> Mapping[str, frozenset[str]]:
    return {method: callers for s in services for method, callers in s.method_permissions.items()}


SERVICES: tuple[ServiceSpec, ...]
NAMES: tuple[str, ...]
GATEWAY: GatewaySpec
STAGE_GROUPS: tuple[ConsumerGroup, ...]
PERMISSIONS: Mapping[str, frozenset[str]]
INTERNAL_SERVICES: frozenset[str]


def __getattr__(name: str) -> Any:
    tables = _cached_tables()
    if name in tables:
        return tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _cached_tables() -> dict[str, Any]:
    return _tables()
