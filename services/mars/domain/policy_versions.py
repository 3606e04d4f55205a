"""Routing policy versions: an immutable, validated config of one routing policy (issue 47, item 1).

A version names the bandit algorithm (mars.domain.bandits) and its parameters, the feature set it routes on
(the state feature map of Table 7 or the projected query embedding), the cost weight lambda of its reward
(r = u - lambda * C_gen; None keeps the judge's), and the arms it chooses among. The router keeps versions in
Postgres per tenant (mars_router.policy_admin); this module is the pure part: validation, the canonical
JSON and its content hash (the same config always hashes the same, whatever the key order or which
defaults were spelt out), the diff of two configs, and the bandit a config builds.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mars.domain.bandits import RoutingPolicy, make_routing_policy
from mars.domain.features import FEATURE_DIM, QUERY_FEATURE_DIM

#: Algorithm -> (the name mars.domain.bandits builds it by, its parameters with defaults and ranges).
ALGORITHMS: dict[str, str] = {"linucb": "linucb", "epsilon_greedy": "eps-greedy", "thompson": "thompson"}
#: Parameter -> (default, low, high) per algorithm; ridge is every algorithm's (A = ridge * I at cold start).
PARAMS: dict[str, dict[str, tuple[float, float, float]]] = {
    "linucb": {"alpha": (0.8, 0.0, 100.0), "ridge": (1.0, 1e-6, 1e6)},
    "epsilon_greedy": {"epsilon": (0.1, 0.0, 1.0), "ridge": (1.0, 1e-6, 1e6)},
    "thompson": {"v": (0.3, 1e-6, 100.0), "ridge": (1.0, 1e-6, 1e6)},
}
#: Feature set -> context dimension (mars.domain.features).
FEATURE_SETS: dict[str, int] = {"state": FEATURE_DIM, "query": QUERY_FEATURE_DIM}
#: The version a tenant without versions routes by: the router's own settings (nothing stored).
DEFAULT_VERSION = "default"
#: Roles a version can hold for a tenant. Canary is reserved for the canary split (routing a share of
#: sessions by the candidate); the router does not route by it yet.
ROLES = ("live", "shadow", "canary")
LAMBDA_MAX = 1e6


class PolicyConfigError(ValueError):
    """A policy config that cannot be used; the message says which field and why."""


@dataclass(frozen=True)
class PolicyConfig:
    algorithm: str
    arms: tuple[str, ...]
    params: Mapping[str, float] = field(default_factory=dict)
    feature_set: str = "state"
    #: Cost weight of this version's reward; None: the judge's (MARS_JUDGE_LAMBDA_COST).
    lambda_cost: float | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise PolicyConfigError(f"unknown algorithm {self.algorithm!r}: one of {', '.join(ALGORITHMS)}")
        if self.feature_set not in FEATURE_SETS:
            raise PolicyConfigError(
                f"unknown feature set {self.feature_set!r}: one of {', '.join(FEATURE_SETS)}"
            )
        arms = tuple(self.arms)
        if not arms or any(not isinstance(a, str) or not a for a in arms):
            raise PolicyConfigError("arms must be a non-empty list of arm names")
        if len(set(arms)) != len(arms):
            raise PolicyConfigError(f"arms repeat: {list(arms)}")
        object.__setattr__(self, "arms", arms)
        object.__setattr__(self, "params", _checked_params(self.algorithm, self.params))
        if self.lambda_cost is not None:
            lam = float(self.lambda_cost)
            if not math.isfinite(lam) or not 0.0 <= lam <= LAMBDA_MAX:
                raise PolicyConfigError(f"lambda {self.lambda_cost} must be in [0, {LAMBDA_MAX:g}]")
            object.__setattr__(self, "lambda_cost", lam)

    @property
    def dim(self) -> int:
        return FEATURE_SETS[self.feature_set]

    def check_arms(self, known: Sequence[str]) -> None:
        """PolicyConfigError naming the arms that are not in the model pool `known`."""
        unknown = [a for a in self.arms if a not in known]
        if unknown:
            raise PolicyConfigError(f"arms {unknown} are not in the model pool {list(known)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "params": dict(sorted(self.params.items())),
            "feature_set": self.feature_set,
            "lambda": self.lambda_cost,
            "arms": list(self.arms),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyConfig:
        extra = set(data) - {"algorithm", "params", "feature_set", "lambda", "arms"}
        if extra:
            raise PolicyConfigError(f"unknown config fields {sorted(extra)}")
        if "algorithm" not in data or "arms" not in data:
            raise PolicyConfigError("a policy config needs algorithm and arms")
        params = data.get("params") or {}
        if not isinstance(params, Mapping):
            raise PolicyConfigError("params must be an object of name -> number")
        arms = data["arms"]
        if isinstance(arms, str) or not isinstance(arms, Sequence):
            raise PolicyConfigError("arms must be a list of arm names")
        return cls(
            algorithm=str(data["algorithm"]),
            arms=tuple(arms),
            params=params,
            feature_set=str(data.get("feature_set", "state")),
            lambda_cost=data.get("lambda"),
        )

    def canonical_json(self) -> str:
        """Sorted keys, no spaces, every default spelt out: equal configs give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def content_hash(self) -> str:
        """sha256 of the canonical JSON (hex): what a version is, whatever it is called."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def routing_policy(self, seed: int | None = None) -> RoutingPolicy:
        """The bandit this config describes (mars.domain.bandits), over its arms and feature dimension."""
        p = self.params
        return make_routing_policy(
            ALGORITHMS[self.algorithm],
            self.arms,
            self.dim,
            alpha=p.get("alpha", 0.8),
            ridge=p["ridge"],
            epsilon=p.get("epsilon", 0.1),
            thompson_v=p.get("v", 0.3),
            seed=seed,
        )


def _checked_params(algorithm: str, given: Mapping[str, Any]) -> dict[str, float]:
    """The algorithm's parameters with defaults filled in; PolicyConfigError for an unknown name or a
    value outside its range."""
    spec = PARAMS[algorithm]
    unknown = sorted(set(given) - set(spec))
    if unknown:
        raise PolicyConfigError(f"{algorithm} has no parameter {unknown}: it takes {', '.join(sorted(spec))}")
    out: dict[str, float] = {}
    for name, (default, low, high) in spec.items():
        raw = given.get(name, default)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise PolicyConfigError(f"{algorithm} parameter {name} must be a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value) or not low <= value <= high:
            raise PolicyConfigError(f"{algorithm} parameter {name}={raw} is outside [{low:g}, {high:g}]")
        out[name] = value
    return out


def diff(old: PolicyConfig, new: PolicyConfig) -> dict[str, tuple[Any, Any]]:
    """Field -> (old, new) for each field that differs; parameters as params.<name>, arms as lists."""
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _flat(config: PolicyConfig) -> dict[str, Any]:
    d = config.to_dict()
    params = d.pop("params")
    return {**d, **{f"params.{k}": v for k, v in params.items()}}


def from_router_settings(
    routing_policy: str,
    arms: Sequence[str],
    alpha: float,
    ridge: float,
    epsilon: float,
    thompson_v: float,
) -> PolicyConfig | None:
    """The router's own settings as a config (the implicit version "default"), or None for a routing
    policy that is not a versionable bandit (random, fixed:<arm>, cascade)."""
    feature_set = "query" if routing_policy == "query-linucb" else "state"
    by_router_name = {v: k for k, v in ALGORITHMS.items()} | {"query-linucb": "linucb"}
    algorithm = by_router_name.get(routing_policy)
    if algorithm is None:
        return None
    values = {"alpha": alpha, "ridge": ridge, "epsilon": epsilon, "v": thompson_v}
    return PolicyConfig(algorithm, tuple(arms), {k: values[k] for k in PARAMS[algorithm]}, feature_set, None)
