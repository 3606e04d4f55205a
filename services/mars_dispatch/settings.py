"""The dispatch service's settings (MARS_* variables): one typed model, read only here."""

from __future__ import annotations

from typing import ClassVar

from mars.config import ServiceSettings


class DispatchSettings(ServiceSettings):
    #: Its own settings are read as MARS_DISPATCH_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "DISPATCH"
    model_pool: str = "config/models.local.yaml"
    default_max_tokens: int = 96
    #: Extra attempts on the same arm for a retryable error (connection trouble, 429, 5xx).
    retries_per_arm: int = 1
    #: Consecutive failed calls after which an arm's circuit opens (turns fall back at once). Only the
    #: endpoint's own failures count: a call cut by the turn's deadline does not.
    circuit_failure_threshold: int = 5
    #: Seconds an open circuit waits before one trial call may close it again.
    circuit_reset_s: float = 30.0
    #: The MEMORY GUIDANCE state header (continuation or topic shift, query type, phase, scope, recency,
    #: lens) in the generator prompt (Fig. 5). False leaves it out, memory blocks and clipping unchanged:
    #: the paper's "No QTM state/header" ablation (mars_semctx_noactive, with MARS_MEMORY_VIEW_POLICY=semantic,
    #: whose view has no active-thread state block either).
    state_header: bool = True
