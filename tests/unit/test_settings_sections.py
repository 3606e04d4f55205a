"""Settings per service (issue 46 item 3): a service's own settings under its section (MARS_ROUTER_ALPHA), the
shared ones flat (MARS_KAFKA_BOOTSTRAP), the old flat names read with a warning for one release, and a
misspelt name that stops the service at start with the name it meant."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from mars import topology
from mars.config import OTHER_NAMES, SECTIONS, CallerSettings, ServiceSettings, env_name, old_env_names
from mars_gateway.settings import GatewaySettings
from mars_memory.settings import MemorySettings
from mars_router.settings import RouterSettings
from mars_stack.settings import LauncherSettings
from mars_tools.settings import ToolSettings

REPO = Path(__file__).resolve().parents[2]
DEPLOYABLES = topology.deployable_settings()


def _every_name_of_the_project() -> set[str]:
    """What any model reads: every deployable's names (current and old), the tools' and the launcher's."""
    names = set(OTHER_NAMES)
    for cls in (*DEPLOYABLES.values(), ToolSettings):
        names |= cls.env_names()
    names |= {f"MARS_{f.upper()}" for f in LauncherSettings.model_fields}
    return names


def test_own_fields_are_read_under_the_section_and_shared_ones_flat() -> None:
    assert env_name(RouterSettings, "alpha") == "MARS_ROUTER_ALPHA"
    assert env_name(RouterSettings, "kafka_bootstrap") == "MARS_KAFKA_BOOTSTRAP"
    # A field that already begins with its section's name is not prefixed twice.
    assert env_name(MemorySettings, "memory_roles") == "MARS_MEMORY_ROLES"
    assert env_name(GatewaySettings, "ingress_addr") == "MARS_GATEWAY_INGRESS_ADDR"
    assert env_name(ToolSettings, "ingress_addr") == "MARS_INGRESS_ADDR"  # tools have no section
    settings = RouterSettings.from_env({"MARS_ROUTER_ALPHA": "0.3", "MARS_KAFKA_PARTITIONS": "5"})
    assert (settings.alpha, settings.kafka_partitions) == (0.3, 5)


def test_every_deployable_has_a_section_of_its_own() -> None:
    sections = [cls.env_section for cls in DEPLOYABLES.values()]
    assert sorted(sections) == sorted(SECTIONS)
    assert isinstance(DEPLOYABLES["gateway"], type) and DEPLOYABLES["gateway"] is GatewaySettings
    assert all(issubclass(cls, ServiceSettings) for name, cls in DEPLOYABLES.items() if name != "gateway")


def test_an_old_flat_name_still_works_with_a_warning_and_the_new_name_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_ALPHA", "0.25")
    with pytest.warns(FutureWarning, match="MARS_ALPHA is deprecated for RouterSettings: set MARS_ROUTER_ALPHA"):
        assert RouterSettings().alpha == 0.25
    monkeypatch.setenv("MARS_ROUTER_ALPHA", "0.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current name is read; the old one is not looked at
        assert RouterSettings().alpha == 0.5
    assert old_env_names(RouterSettings, "alpha") == ("MARS_ALPHA",)
    assert old_env_names(RouterSettings, "kafka_bootstrap") == ()


def test_names_in_the_env_file_are_read_by_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "service.env"
    env_file.write_text("MARS_ROUTER_EPSILON=0.4\nMARS_HANDLER_ATTEMPTS=7\n")
    settings = RouterSettings(_env_file=str(env_file))  # type: ignore[call-arg]
    assert (settings.epsilon, settings.handler_attempts) == (0.4, 7)
    with pytest.raises(ValueError, match="did you mean MARS_ROUTER_EPSILON"):
        env_file.write_text("MARS_ROUTER_EPSILOM=0.4\n")
        RouterSettings.check_environment({"MARS_ENV_FILE": str(env_file)})


@pytest.mark.parametrize(
    ("cls", "name", "meant"),
    [
        (RouterSettings, "MARS_ROUTRE_ALPHA", "MARS_ROUTER_ALPHA"),
        (RouterSettings, "MARS_ROUTER_ALPA", "MARS_ROUTER_ALPHA"),
        (RouterSettings, "MARS_KAFKA_BOOTSTRAPP", "MARS_KAFKA_BOOTSTRAP"),
        (MemorySettings, "MARS_MEMORY_VIEWPOLICY", "MARS_MEMORY_VIEW_POLICY"),
        (GatewaySettings, "MARS_GATEWAY_HTTP_PROT", "MARS_GATEWAY_HTTP_PORT"),
    ],
)
def test_a_misspelt_name_is_refused_with_the_name_it_meant(cls: type[CallerSettings], name: str, meant: str) -> None:
    with pytest.raises(ValueError, match=f"{name} is not a setting of {cls.__name__}; did you mean {meant}"):
        cls.check_environment({name: "1"}, elsewhere=topology.deployable_env_names())


def test_no_name_the_project_reads_is_refused_by_any_deployable() -> None:
    """Every process gets names meant for others (the local stack hands its environment on, a shell holds the
    tools' names): none of the project's own names, current or old, may stop a deployable."""
    names = _every_name_of_the_project()
    assert len(names) > 150
    elsewhere = topology.deployable_env_names()
    for cls in DEPLOYABLES.values():
        assert cls.misread_names(names, elsewhere) == [], cls.__name__
    # Names of another section are that deployable's to check, even misspelt.
    assert RouterSettings.misread_names(["MARS_MEMORY_VIEW_POLCY"], elsewhere) == []
    assert MemorySettings.misread_names(["MARS_MEMORY_VIEW_POLCY"], elsewhere) != []


def test_a_service_started_with_a_misspelt_name_refuses_to_start_and_names_the_right_one() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARS_")}
    env["MARS_ROUTRE_ALPHA"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "mars_router"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "MARS_ROUTRE_ALPHA is not a setting of RouterSettings; did you mean MARS_ROUTER_ALPHA?" in done.stderr
    assert "Traceback" not in done.stderr


#: Names the docs mention that no model reads now, on purpose: old names (said to be old), the example of a
#: misspelling, and the placeholder of `--set MARS_KEY=VALUE`.
MENTIONED_AS_NOT_READ = {"MARS_ALPHA", "MARS_CONTEXT_TURNS", "MARS_ROUTRE_ALPHA", "MARS_KEY"}


def _current_names() -> set[str]:
    names = set(OTHER_NAMES)
    for cls in (*DEPLOYABLES.values(), ToolSettings):
        names |= {env_name(cls, f) for f in cls.model_fields}
    return names | {f"MARS_{f.upper()}" for f in LauncherSettings.model_fields}


def _names_in(text: str) -> set[str]:
    # A name followed by "*" is a family (MARS_GATEWAY_*), not a setting.
    found = re.findall(r"(?<![A-Za-z0-9_])(MARS_[A-Z0-9_]*)(\*?)", text)
    return {name.rstrip("_") for name, star in found if not star and name.rstrip("_") != "MARS"}


def test_every_name_in_the_docs_is_one_a_model_reads_now() -> None:
    """The README, the chart's and the load harness's READMEs and the env examples name settings as the models
    read them now (an old name there would teach the deprecated spelling)."""
    docs = ["README.md", "charts/README.md", "load-tests/README.md"]
    docs += [p for p in subprocess.run(["git", "ls-files", "*.env", "*.env.example"], cwd=REPO, capture_output=True,
                                       text=True, check=True).stdout.split()]
    current = _current_names()
    stale = {doc: sorted(_names_in((REPO / doc).read_text()) - current - MENTIONED_AS_NOT_READ) for doc in docs}
    assert {doc: names for doc, names in stale.items() if names} == {}
    # The check can fail: an old name in a copy of the README is found.
    assert _names_in("set `MARS_VIEW_POLICY` or MARS_GATEWAY_* or MARS_TLS_CLIENT_*") - current == {"MARS_VIEW_POLICY"}


def test_kubernetes_service_links_are_not_taken_for_settings() -> None:
    """A pod gets <SERVICE>_SERVICE_HOST, <SERVICE>_PORT_<n>_TCP_ADDR, ... for every Service of its namespace:
    the chart's Service mars-router gives MARS_ROUTER_SERVICE_HOST to every MARS pod (found on a real node)."""
    links = [
        "MARS_ROUTER_SERVICE_HOST",
        "MARS_ROUTER_SERVICE_PORT",
        "MARS_ROUTER_SERVICE_PORT_GRPC",
        "MARS_ROUTER_PORT",
        "MARS_ROUTER_PORT_50053_TCP",
        "MARS_ROUTER_PORT_50053_TCP_ADDR",
        "MARS_ROUTER_PORT_9464_TCP_PROTO",
    ]
    assert RouterSettings.misread_names(links, topology.deployable_env_names()) == []
    assert RouterSettings.misread_names(["MARS_ROUTER_PORTS"], topology.deployable_env_names()) != []
