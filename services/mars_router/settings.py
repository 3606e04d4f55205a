"""The router service's settings (MARS_* variables): one typed model, read only here."""

from __future__ import annotations

from typing import ClassVar, Literal

from mars.config import ServiceSettings
from mars.domain.rollout import RolloutConfig
from pydantic import Field, model_validator


class RouterSettings(ServiceSettings):
    #: Its own settings are read as MARS_ROUTER_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "ROUTER"
    model_pool: str = "config/models.local.yaml"
    alpha: float = 0.8
    ridge: float = 1.0
    #: The paper keeps one policy per user; tenant or global share learning across users.
    policy_scope: Literal["user", "tenant", "global"] = "user"
    #: A new user policy copies its tenant policy's matrices ("tenant:<tenant>") when one exists.
    warm_start_from_tenant: bool = False
    #: linucb (the paper's), thompson, eps-greedy, random, fixed:<arm>, query-linucb (LinUCB over the query
    #: embedding without session state: the no-QTM / MetaLLM-style baseline), or cascade (cheapest arm
    #: first, escalating by price while the answer's mean token log-probability is below cascade_min_logprob).
    routing_policy: str = "linucb"
    cascade_min_logprob: float = -1.0
    epsilon: float = 0.1
    thompson_v: float = 0.3
    #: Seed of the stochastic policies (thompson, eps-greedy, random). Set, each turn draws from its own
    #: generator seeded by (seed, user_id, seq), so a re-drive of the same log with the same configuration
    #: and seed makes the same decisions whatever the process, restart or interleaving of users. Unset
    #: (default): draws come from OS entropy. Keyed on (user_id, seq), not turn_id, because ingress mints
    #: a fresh turn_id for every re-driven turn while a user's seq repeats (also under --tenant-suffix).
    routing_seed: int | None = None
    #: Session affinity: UCB points an arm other than the session's previous one loses (0 = off).
    switch_penalty: float = 0.0
    #: Arm used when a policy's matrices fail the sanity check (default: the pool's first arm).
    default_arm: str | None = None
    #: Rewards outside this range are rejected (utility is in [0, 1]; cost only lowers it).
    min_reward: float = -1000.0
    max_reward: float = 1.0
    #: Attempts at an optimistic policy update before the reward is handed back for redelivery.
    update_attempts: int = 50
    #: Online updates (Eq. 11). False freezes every policy as it is (the paper's "No online update"
    #: diagnostic): routing uses the current matrices, judged rewards and corrections are checked and
    #: recorded in the ledger with applied = false, and A, b and the version stay unchanged. Recording
    #: them means turning updates back on starts learning from the next judged turn: a redelivered or
    #: replayed reward from the frozen period is a ledger duplicate, never applied late to a policy that
    #: did not choose by it, and the reward stays visible to whoever reads the ledger.
    policy_updates: bool = True
    #: How long a replica caches a tenant's policy versions (live, shadow; mars_router.versions) before
    #: reading them again: a `mars policy promote|rollback|activate` routes every replica's turns within
    #: about this many seconds.
    policy_config_ttl_s: float = Field(default=0.5, ge=0.0, le=60.0)
    #: Canary runs (`mars policy canary`, mars.domain.rollout): the share of a tenant's sessions its canary
    #: version routes, the reward test's level, the turn cap after which an open test ends undecided, the
    #: judged turns each side needs before any decision, the effect and reward sd the test is tuned for, and
    #: the guardrails (their level; the failure-rate excess, the cost ratio and the judge-utility floor past
    #: which the canary is rolled back at once; a negative utility floor turns that guardrail off).
    rollout_share: float = Field(default=0.5, gt=0.0, lt=1.0)
    rollout_alpha: float = Field(default=0.05, gt=0.0, lt=1.0)
    rollout_cap: int = Field(default=10_000, ge=4)
    rollout_warmup: int = Field(default=100, ge=2)
    rollout_expected_effect: float = Field(default=0.05, gt=0.0)
    rollout_reward_sd: float = Field(default=0.2, gt=0.0)
    rollout_guardrail_alpha: float = Field(default=0.01, gt=0.0, lt=1.0)
    rollout_max_failure_excess: float = Field(default=0.02, ge=0.0)
    rollout_max_cost_ratio: float = Field(default=1.5, gt=0.0)
    rollout_min_utility: float = 0.4

    @model_validator(mode="after")
    def _rollout_valid(self) -> RouterSettings:
        self.rollout_config()  # a bad combination (cap under twice the warm-up) fails at start, with why
        return self

    def rollout_config(self) -> RolloutConfig:
        """The canary test's configuration (mars.domain.rollout.RolloutConfig) from these settings."""
        return RolloutConfig(
            alpha=self.rollout_alpha,
            canary_share=self.rollout_share,
            max_turns=self.rollout_cap,
            warmup_turns=self.rollout_warmup,
            expected_effect=self.rollout_expected_effect,
            reward_sd=self.rollout_reward_sd,
            guardrail_alpha=self.rollout_guardrail_alpha,
            max_failure_excess=self.rollout_max_failure_excess,
            max_cost_ratio=self.rollout_max_cost_ratio,
            min_utility=self.rollout_min_utility if self.rollout_min_utility >= 0 else None,
        )
