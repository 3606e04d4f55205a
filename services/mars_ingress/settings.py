"""The ingress service's settings (MARS_* variables): one typed model, read only here."""

from __future__ import annotations

from typing import ClassVar, Literal

from mars.config import (
    ServiceSettings,
)
from pydantic import Field

from mars_ingress.quota import TenantLimits


class IngressSettings(ServiceSettings):
    #: Its own settings are read as MARS_INGRESS_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "INGRESS"
    max_text_chars: int = 8000
    #: How long a call waits for its answer before DEADLINE_EXCEEDED (the turn stays recorded).
    turn_timeout_s: float = 180.0
    #: Seconds past its deadline after which a turn still PENDING (its waiting replica died before the
    #: answer came) is marked TIMEOUT by whichever replica sweeps first.
    orphan_grace_s: float = 5.0
    orphan_sweep_every_s: float = 2.0
    #: How long ForgetUser waits for every other service to acknowledge that it deleted its rows of the
    #: user (mars.forget); those that have not by then are named in the reply.
    forget_wait_s: float = Field(default=10.0, ge=0.0)
    #: A PENDING turn that no state replica has taken after this long is published again from the outbox
    #: (its replica may have died before publishing it); duplicates are harmless (effects by turn_id).
    republish_after_s: float = 10.0
    #: Every call must carry a tenant API key (`authorization: Bearer <key>`, see mars.auth); false lets
    #: anyone act as any tenant named in the request (a closed test network only).
    auth_required: bool = True
    #: How long a verified (or refused) key is remembered per process: a revoked key keeps working for at
    #: most this long; 0 looks every call up in Postgres.
    auth_cache_ttl_s: float = Field(default=5.0, ge=0)
    #: Per-tenant rate limits (mars_ingress.quota), 0 = unlimited: turns per second with a burst (0: max(1, rate)),
    #: text tokens per minute (the request text, by the packing estimator), and USD per UTC day (the judged
    #: generator + controller + judge cost of the tenant's turns).
    quota_turns_per_s: float = Field(default=0.0, ge=0)
    quota_turn_burst: float = Field(default=0.0, ge=0)
    quota_tokens_per_min: float = Field(default=0.0, ge=0)
    quota_usd_per_day: float = Field(default=0.0, ge=0)
    #: Per-tenant overrides of the four limits above, as JSON: {"acme": {"turns_per_s": 5, "usd_per_day": 20}}
    #: (an overridden tenant gets exactly what is given; fields left out are unlimited).
    quota_tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    #: Ingress replicas sharing the limits: buckets are per process, so each enforces 1/N of each rate.
    quota_replicas: int = Field(default=1, ge=1)
    #: How long a tenant's spend today is cached before Postgres is asked again.
    quota_spend_cache_s: float = Field(default=5.0, ge=0)
    #: How long the budgets per user and per key (`mars tenant set-budget`, mars_ingress.budgets) are cached
    #: per (tenant, user, key) before Postgres is asked again: a changed budget holds within this time.
    #: The use they are checked against is read fresh for each turn they apply to.
    quota_budget_cache_s: float = Field(default=5.0, ge=0)
    #: ImportHistory with wait: the longest it waits for the memory service to store the pairs when the
    #: call itself has no deadline.
    import_wait_s: float = Field(default=600.0, gt=0)
    #: The state service (host:port), which takes the context a history import leaves active
    #: (StateEstimator.ImportContext, with this service's identity, MARS_IDENTITY_CERT_FILE / _KEY_FILE);
    #: empty: imports leave the controller's context as it is (a warning at start).
    state_addr: str = ""
    #: Load shedding (mars.domain.concurrency): at most an adaptive number of turns in flight per replica,
    #: shared fairly by tenant; a turn beyond it gets RESOURCE_EXHAUSTED at once with retry-after-ms (and
    #: grpc-retry-pushback-ms: mars_ingress.client's channels send it again). Off by default for now: as tuned, it
    #: holds the pipeline below what it can answer (README, "Load shedding"). Off, the limit still learns
    #: and is reported (mars.admission.limit), and nothing is shed.
    admission_limit: bool = False
    #: latency: AIMD on the time in MARS against its no-load value (MARS_INGRESS_ADMISSION_TOLERANCE); throughput:
    #: gain x the best answer rate x the shortest turn time (MARS_INGRESS_ADMISSION_GAIN); gradient: the time in
    #: MARS against its level while the limit did not bind (same tolerance and window; mars.domain.concurrency).
    admission_algorithm: Literal["latency", "throughput", "gradient"] = "latency"
    admission_gain: float = Field(default=1.5, ge=1.0)
    admission_initial_limit: int = Field(default=16, ge=1)
    admission_min_limit: int = Field(default=2, ge=1)
    admission_max_limit: int = Field(default=256, ge=1)
    #: A window's median time in MARS (end-to-end minus the model calls) above this times its no-load value
    #: shrinks the limit.
    admission_tolerance: float = Field(default=2.0, gt=1.0)
    #: The limit grows only after a window whose median stayed below this times the no-load value; between
    #: this and the tolerance it holds. Unset: the tolerance (no band).
    admission_grow_below: float | None = Field(default=None, gt=1.0)
    #: Answered turns per limit decision.
    admission_window: int = Field(default=16, ge=1)
    admission_retry_after_ms: int = Field(default=1000, ge=0)
    #: Turns in flight and none finished for this long is a stall (a stage restarting), not an overload:
    #: nothing is shed until a turn finishes again.
    admission_stall_s: float = Field(default=2.0, gt=0)
    #: Tenants' weights in the fair shares, as JSON ({"acme": 2}); unnamed tenants weigh 1.
    admission_tenant_weights: dict[str, float] = Field(default_factory=dict)

    def longest_call_s(self) -> float:
        # A turn may wait turn_timeout_s for its answer; a connection's max-age GOAWAY must not cut it
        # (with the stop's 12 s, every turn over ~15 s failed "UNAVAILABLE: max connection age").
        return self.turn_timeout_s + 5.0
