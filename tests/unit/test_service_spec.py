"""One spec per deployable (issue 46 item 2): each package's SPEC is what mars.topology gives for its name,
the entry-point table is where topology finds them (and it says so when the install lacks it), and a service
process starts from its spec (mars.runtime.run)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mars import runtime, topology
from mars.spec import ConsumerGroup, GatewaySpec, ServiceSpec
from mars_router.settings import RouterSettings
from mars_router.spec import SPEC as ROUTER

REPO = Path(__file__).resolve().parents[2]
TABLE: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][
    "mars.deployables"
]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_deployables_spec_is_what_the_topology_gives_for_its_name(name: str) -> None:
    module, _, attribute = TABLE[name].partition(":")
    assert module == f"mars_{name}.spec" and attribute == "SPEC", "a deployable's spec lives in its own package"
    spec = getattr(importlib.import_module(module), attribute)
    assert spec.name == name
    if isinstance(spec, GatewaySpec):
        assert topology.GATEWAY is spec and name not in topology.NAMES
    else:
        assert topology.service(name) is spec
    assert topology.deployable_settings()[name] is spec.settings


def test_the_installed_entry_points_are_pyprojects_table() -> None:
    """An install made before the table changed has stale metadata: `make install` again."""
    installed = {ep.name: ep.value.replace(" ", "") for ep in importlib.metadata.entry_points(group=topology.ENTRY_POINTS)}
    assert installed == TABLE


def test_the_services_come_in_start_order_and_their_groups_are_their_own() -> None:
    assert topology.NAMES == topology.START_ORDER
    assert all(isinstance(s, ServiceSpec) and isinstance(s.settings, type) for s in topology.SERVICES)
    assert topology.STAGE_GROUPS == tuple(g for s in topology.SERVICES for g in s.groups)
    for spec in topology.SERVICES:
        assert all(g.service == spec.name and topology.group(g.name) is g for g in spec.groups)
    with pytest.raises(ValueError, match="another service"):
        dataclasses.replace(ROUTER, groups=(ConsumerGroup("mars-x", "judge", ()),))


def test_a_stages_permissions_are_its_own_methods() -> None:
    assert ROUTER.internal and set(ROUTER.method_permissions) <= set(topology.PERMISSIONS)
    assert all(m.startswith("/mars.v1.Router/") for m in ROUTER.method_permissions)
    assert not topology.service("ingress").internal
    assert topology.INTERNAL_SERVICES == {s.grpc_service for s in topology.SERVICES if s.permissions}


@pytest.fixture
def no_entry_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(topology.importlib.metadata, "entry_points", lambda group: [])
    topology.deployables.cache_clear()
    topology._cached_tables.cache_clear()
    yield
    monkeypatch.undo()
    topology.deployables.cache_clear()
    topology._cached_tables.cache_clear()


@pytest.mark.usefixtures("no_entry_points")
def test_the_topology_without_its_entry_points_fails_saying_how_to_fix_it() -> None:
    with pytest.raises(topology.TopologyError, match=r"'mars\.deployables' entry points.*make install"):
        topology.service("router")
    with pytest.raises(topology.TopologyError, match="no deployables"):
        _ = topology.NAMES


def test_importing_the_topology_loads_no_deployable() -> None:
    """The tables are computed on first use: importing the library imports no deployable."""
    probe = "import sys, mars.topology; print(sorted(m for m in sys.modules if m.startswith('mars_')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_run_makes_the_settings_from_the_spec_and_serves_its_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    class OnAsyncio(RouterSettings):
        uvloop: bool = False

    spec = dataclasses.replace(ROUTER, settings=OnAsyncio)
    served: list[tuple[ServiceSpec, Any, Any]] = []

    async def serve(spec: ServiceSpec, settings: Any, build: Any) -> None:
        served.append((spec, settings, build))

    async def build(ctx: runtime.ServiceContext) -> runtime.ServiceParts:
        raise AssertionError("not called: serve is replaced")

    monkeypatch.setattr(runtime, "serve", serve)
    runtime.run(spec, build)
    ((got_spec, settings, got_build),) = served
    assert got_spec is spec and got_build is build
    assert type(settings) is OnAsyncio


def test_run_stops_on_a_misspelt_name_naming_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_ROUTER_ALPA", "1")
    with pytest.raises(SystemExit, match=r"^router: MARS_ROUTER_ALPA is not a setting of RouterSettings"):
        runtime.service_settings(ROUTER)


def test_a_spec_declared_twice_is_one_deployable_and_two_different_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two installs of the project on the path (an editable one and a wheel) declare the same specs."""
    entries = topology._load_entry_points()
    try:
        monkeypatch.setattr(topology, "_load_entry_points", lambda: entries + entries)
        topology.deployables.cache_clear()
        assert topology.deployables().services == topology.SERVICES
        other = dataclasses.replace(ROUTER)
        monkeypatch.setattr(topology, "_load_entry_points", lambda: [*entries, ("router", other)])
        topology.deployables.cache_clear()
        with pytest.raises(topology.TopologyError, match="two different specs"):
            topology.deployables()
    finally:
        monkeypatch.undo()
        topology.deployables.cache_clear()
