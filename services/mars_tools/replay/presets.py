"""Configurations for `mars replay run`: named ablation presets (paper Table 17, the cost weights of Table 19,
other routing policies) as sets of MARS_* settings, override files, and the check that every override
names a real service setting with a value that setting accepts.

Every Table 17 row has a preset. "No QTM state/header" (mars_semctx_noactive) starts from the
embedding-only row and leaves the MEMORY GUIDANCE state header out of the generator prompt
(dispatch's MARS_DISPATCH_STATE_HEADER=false; the semantic view has no active-thread state block either).
"No online update" (mars_full_no_update) keeps full MARS with a frozen router (MARS_ROUTER_POLICY_UPDATES=false):
it routes with its cold-start matrices and records judged rewards without applying them, so the policy
version never moves; the paper reads it as a cold-start adaptation diagnostic, not a static-router baseline.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars import topology
from mars.config import CallerSettings, env_name, old_env_names
from pydantic import ValidationError

#: Settings the replay stack sets itself (addresses, ports, the run's topic prefix): never overridden.
STACK_MANAGED = frozenset(
    {
        "MARS_KAFKA_BOOTSTRAP",
        "MARS_POSTGRES_DSN",
        "MARS_GRPC_HOST",
        "MARS_GRPC_PORT",
        "MARS_TOPIC_PREFIX",
        "MARS_STATE_LOCAL_LLM_URL",
        "MARS_JUDGE_LOCAL_LLM_URL",
    }
)


@dataclass(frozen=True)
class Preset:
    name: str
    #: What it changes, with the paper's variant id where there is one.
    description: str
    overrides: Mapping[str, str] = field(default_factory=dict)


_NO_QTM_ROUTER = {"MARS_ROUTER_ROUTING_POLICY": "query-linucb", "MARS_MEMORY_VIEW_QUERY_EMBEDDING": "true"}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("full", "Full MARS (mars_full): the defaults"),
        Preset(
            "embedding-only",
            "Embedding-only semantic memory (mars_embedctx_bm): raw-query semantic top-k instead of the "
            "state-guided view",
            {"MARS_MEMORY_VIEW_POLICY": "semantic"},
        ),
        Preset(
            "no-state-header",
            "No QTM state/header (mars_semctx_noactive): embedding-only semantic memory and a generator "
            "prompt without the MEMORY GUIDANCE state header",
            {"MARS_MEMORY_VIEW_POLICY": "semantic", "MARS_DISPATCH_STATE_HEADER": "false"},
        ),
        Preset(
            "recent-only",
            "Recent-only memory (mars_recentctx_bm): the last k turns, no retrieval",
            {"MARS_MEMORY_VIEW_POLICY": "recent"},
        ),
        Preset(
            "no-qtm-semantic",
            "No-QTM semantic (mars_noqtm_semctx): semantic memory, router on query-embedding features",
            {"MARS_MEMORY_VIEW_POLICY": "semantic", **_NO_QTM_ROUTER},
        ),
        Preset(
            "no-qtm-recent",
            "No-QTM recent (mars_noqtm_recentctx): recent-only memory, router on query-embedding features",
            {"MARS_MEMORY_VIEW_POLICY": "recent", **_NO_QTM_ROUTER},
        ),
        Preset(
            "no-online-update",
            "No online update (mars_full_no_update): full MARS with the router frozen at its cold start "
            "(rewards recorded, never applied)",
            {"MARS_ROUTER_POLICY_UPDATES": "false"},
        ),
        Preset("random-routing", "Uniformly random arm per turn", {"MARS_ROUTER_ROUTING_POLICY": "random"}),
        Preset("thompson", "Linear Thompson sampling instead of LinUCB", {"MARS_ROUTER_ROUTING_POLICY": "thompson"}),
        Preset("eps-greedy", "Epsilon-greedy instead of LinUCB", {"MARS_ROUTER_ROUTING_POLICY": "eps-greedy"}),
        Preset("lambda-0", "Cost weight lambda = 0 (Table 19)", {"MARS_JUDGE_LAMBDA_COST": "0"}),
        Preset("lambda-0.25", "Cost weight lambda = 0.25 (Table 19)", {"MARS_JUDGE_LAMBDA_COST": "0.25"}),
        Preset(
            "lambda-0.5",
            "Cost weight lambda = 0.5 (the Table 18 ablation setting)",
            {"MARS_JUDGE_LAMBDA_COST": "0.5"},
        ),
        Preset("lambda-1", "Cost weight lambda = 1.0 (Table 19)", {"MARS_JUDGE_LAMBDA_COST": "1.0"}),
    )
}
#: `fixed:<arm>`: every turn to one arm of the pool (the arm is the pool's, so it is not in the table).
FIXED_PREFIX = "fixed:"


def preset(name: str) -> Preset:
    """A preset by name (or `fixed:<arm>`); ValueError listing the known names otherwise."""
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith(FIXED_PREFIX) and len(name) > len(FIXED_PREFIX):
        arm = name[len(FIXED_PREFIX) :]
        return Preset(name, f"Every turn to arm {arm}", {"MARS_ROUTER_ROUTING_POLICY": name})
    raise ValueError(
        f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}, {FIXED_PREFIX}<arm> "
        "(or give a YAML/JSON/env file of MARS_* settings)"
    )


def settings_classes() -> dict[str, type[CallerSettings]]:
    """Each deployable's settings model, by name (from the topology): the services' and the gateway's."""
    return topology.deployable_settings()


def settings_fields() -> dict[str, list[str]]:
    """Every MARS_* variable some service reads (by its current name), with the services that read it."""
    out: dict[str, list[str]] = {}
    for service, cls in settings_classes().items():
        for name in cls.model_fields:
            out.setdefault(env_name(cls, name), []).append(service)
    return out


def renamed_settings() -> dict[str, list[str]]:
    """Each old MARS_* name (the flat names before sections) with the current names it stands for."""
    out: dict[str, list[str]] = {}
    for cls in settings_classes().values():
        for name in cls.model_fields:
            for old in old_env_names(cls, name):
                out.setdefault(old, []).append(env_name(cls, name))
    return {old: sorted(set(names)) for old, names in out.items()}


def _env_value(key: str, value: Any) -> str:
    if value is None:
        raise ValueError(f"{key} has no value")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def normalize(overrides: Mapping[str, Any]) -> dict[str, str]:
    """Keys as MARS_* variable names (`lambda_cost` and `MARS_JUDGE_LAMBDA_COST` alike: a field's name stands
    for its name in every service that has the field), values as env strings."""
    classes = settings_classes()
    out = {}
    for key, value in overrides.items():
        name = str(key).strip()
        if name.upper().startswith("MARS_"):
            names = [name.upper()]
        else:
            field_name = name.lower()
            names = [env_name(cls, field_name) for cls in classes.values() if field_name in cls.model_fields]
            names = sorted(set(names)) or [f"MARS_{name.upper()}"]  # unknown: check() says so
        for env in names:
            out[env] = _env_value(env, value)
    return out


def load_file(path: Path) -> dict[str, str]:
    """MARS_* overrides from a YAML or JSON mapping, or an env file (KEY=VALUE lines)."""
    if not path.is_file():
        raise ValueError(f"no config file at {path}")
    text = path.read_text()
    data: Any
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        from dotenv import dotenv_values

        data = {k: v for k, v in dotenv_values(path).items()}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of MARS_* settings, got {type(data).__name__}")
    return normalize(data)


def parse_set(items: Iterable[str]) -> dict[str, str]:
    """`--set KEY=VALUE` items."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        out[key] = value
    return normalize(out)


def resolve(configs: Iterable[str], sets: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """The overrides of `--config` items (preset names or files, in order) and then `--set` items, checked;
    with a label per item for the comparison's header."""
    overrides: dict[str, str] = {}
    labels = []
    for item in configs:
        path = Path(item)
        looks_like_file = path.is_file() or "/" in item or path.suffix in (".yaml", ".yml", ".json", ".env")
        if looks_like_file:
            overrides.update(load_file(path))
            labels.append(path.name)
        else:
            overrides.update(preset(item).overrides)
            labels.append(item)
    extra = parse_set(sets)
    overrides.update(extra)
    labels += [f"{k}={v}" for k, v in extra.items()]
    check(overrides)
    return overrides, labels


def check(overrides: Mapping[str, str]) -> None:
    """ValueError unless every key is a setting some service reads (and not one the stack sets) and every
    value parses as that setting."""
    fields = settings_fields()
    renamed = renamed_settings()
    problems = []
    for key in overrides:
        if key in STACK_MANAGED:
            problems.append(f"{key} is set by the replay stack itself")
        elif key in renamed and key not in fields:
            problems.append(f"{key} is an old name: set {' and '.join(renamed[key])}")
        elif key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problems.append(f"{key} is not a setting of any service{hint}")
    if problems:
        raise ValueError("; ".join(problems))
    touched = {service for key in overrides for service in fields[key]}
    classes = settings_classes()
    for service in sorted(touched):
        cls = classes[service]
        try:
            cls.from_env(overrides)  # the overrides alone, over the defaults
        except ValidationError as exc:
            errors = "; ".join(
                f"{env_name(cls, str(e['loc'][0]))}: {e['msg']}" if e["loc"] else e["msg"] for e in exc.errors()
            )
            raise ValueError(f"{service} settings refuse the overrides: {errors}") from exc
