"""Rule-based QTM estimator and the guardrails applied to any controller output (paper Table 5, Fig. 3).

`clamp_state` is the post-processing step of Appendix B.1/B.2: whatever a controller emits (LLM JSON or the
rules below), only allowed values leave this module, and every correction is recorded in `clamped_fields`
so operators can see how often the controller misbehaves. `estimate_state` is the deterministic fallback
controller used when no LLM is configured or the LLM output cannot be parsed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars.domain.text import overlap, tokenize
from mars.v1 import events_pb2 as ev

ALLOWED_TOP_K: tuple[int, ...] = (3, 5, 8)
ALLOWED_LENS: tuple[int, ...] = (0, 3)

# Conservative defaults (Appendix B.2): continuation with memory enabled and a medium retrieval budget.
DEFAULT_ACTION = ev.MATCH
DEFAULT_QUERY_TYPE = ev.DYNAMIC
DEFAULT_PHASE = ev.EXPLORE
DEFAULT_NEED_MEMORY = 1
DEFAULT_MEMORY_SPAN = ev.ACTIVE_THREAD
DEFAULT_AMBIGUITY = ev.MEDIUM
DEFAULT_LENS = 3
DEFAULT_TOP_K = 5
DEFAULT_PREFER_RECENT = 0
DEFAULT_SCOPE = ev.LOCAL
DEFAULT_CONFIDENCE = 0.5
DEFAULT_REASON = "Conservative fallback: controller gave no usable reason."


def _enum_value(enum: Any, value: Any) -> int | None:
    """Map an enum name (case-insensitive) or a non-zero number to its value; None if not allowed."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        name = value.strip().upper()
        if name in enum.keys() and not name.endswith("_UNSPECIFIED"):
            return int(enum.Value(name))
        return None
    if isinstance(value, int) and value != 0 and value in enum.values():
        return int(value)
    return None


def _as_number(value: Any) -> float | None:
    """Parse ints, floats and numeric strings; reject bools, NaN and infinities."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        num = float(value)
    except (TypeError, ValueError):
        return None
    return num if math.isfinite(num) else None


def _as_flag(value: Any) -> int | None:
    """0/1 flags as an LLM may write them: 0, 1, true, false, "0", "1"."""
    if isinstance(value, bool):
        return int(value)
    num = _as_number(value)
    if num in (0.0, 1.0):
        return int(num)  # type: ignore[arg-type]
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return int(value.strip().lower() == "true")
    return None


def _nearest_top_k(value: Any) -> tuple[int, bool]:
    """(top_k, clamped): allowed values pass; other numbers map to the nearest allowed (ties go larger)."""
    num = _as_number(value)
    if num is None:
        return DEFAULT_TOP_K, True
    if num in ALLOWED_TOP_K:
        return int(num), False
    best = min(ALLOWED_TOP_K, key=lambda k: (abs(k - num), -k))
    return best, True


# Returns Any: proto enum fields are typed per enum in the stubs, but they accept their int values.
def _enum_field(raw: Mapping[str, Any], key: str, enum: Any, default: int, clamped: list[str]) -> Any:
    val = _enum_value(enum, raw.get(key))
    if val is None:
        clamped.append(key)
        return default
    return val


def clamp_state(raw: Mapping[str, Any]) -> ev.SessionState:
    """Validate a raw controller dict into a SessionState, replacing bad fields with conservative values."""
    st = ev.SessionState()
    clamped: list[str] = []
    st.action = _enum_field(raw, "action", ev.Action, DEFAULT_ACTION, clamped)
    st.query_type = _enum_field(raw, "query_type", ev.QueryType, DEFAULT_QUERY_TYPE, clamped)
    st.phase = _enum_field(raw, "phase", ev.Phase, DEFAULT_PHASE, clamped)
    tax_raw = raw.get("taxonomy")
    _clamp_taxonomy(st, tax_raw if isinstance(tax_raw, Mapping) else {}, clamped)
    _clamp_retrieval(st, raw, clamped)
    _revision_guardrail(st, clamped)
    # dict.fromkeys keeps first-seen order while dropping duplicates from the guardrail pass.
    st.clamped_fields.extend(dict.fromkeys(clamped))
    return st


def _clamp_taxonomy(st: ev.SessionState, tax: Mapping[str, Any], clamped: list[str]) -> None:
    need = _as_flag(tax.get("need_memory"))
    if need is None:
        clamped.append("taxonomy.need_memory")
        need = DEFAULT_NEED_MEMORY
    st.taxonomy.need_memory = need
    span: Any = _enum_value(ev.MemorySpan, tax.get("memory_span"))
    if span is None:
        clamped.append("taxonomy.memory_span")
        span = DEFAULT_MEMORY_SPAN
    st.taxonomy.memory_span = span
    amb: Any = _enum_value(ev.Ambiguity, tax.get("ambiguity"))
    if amb is None:
        clamped.append("taxonomy.ambiguity")
        amb = DEFAULT_AMBIGUITY
    st.taxonomy.ambiguity = amb
    flags = tax.get("risk_flags", [])
    if isinstance(flags, list | tuple) and all(isinstance(f, str) for f in flags):
        st.taxonomy.risk_flags.extend(flags)
    else:
        clamped.append("taxonomy.risk_flags")


def _clamp_retrieval(st: ev.SessionState, raw: Mapping[str, Any], clamped: list[str]) -> None:
    """Lens, top-k, recency, scope, and the lens's confidence and reason."""
    lens = _as_number(raw.get("lens_recommendation"))
    if lens not in ALLOWED_LENS:
        clamped.append("lens_recommendation")
        lens = DEFAULT_LENS
    st.lens_recommendation = int(lens)  # type: ignore[arg-type]

    top_k, top_k_clamped = _nearest_top_k(raw.get("top_k_hint"))
    if top_k_clamped:
        clamped.append("top_k_hint")
    st.top_k_hint = top_k

    recent = _as_flag(raw.get("prefer_recent"))
    if recent is None:
        clamped.append("prefer_recent")
        recent = DEFAULT_PREFER_RECENT
    st.prefer_recent = recent

    st.retrieval_scope = _enum_field(raw, "retrieval_scope", ev.RetrievalScope, DEFAULT_SCOPE, clamped)

    conf = _as_number(raw.get("lens_confidence"))
    if conf is None:
        clamped.append("lens_confidence")
        conf = DEFAULT_CONFIDENCE
    elif not 0.0 <= conf <= 1.0:
        clamped.append("lens_confidence")
        conf = min(1.0, max(0.0, conf))
    st.lens_confidence = conf

    reason = raw.get("lens_reason")
    if isinstance(reason, str) and reason.strip():
        st.lens_reason = reason.strip()
    else:
        clamped.append("lens_reason")
        st.lens_reason = DEFAULT_REASON


def _revision_guardrail(st: ev.SessionState, clamped: list[str]) -> None:
    # Guardrail (Fig. 3 note): a revision/verification turn that claims a topic switch is far more likely
    # a continuation the controller mis-segmented; dropping the thread would make the model restart the
    # artifact.
    if st.phase in (ev.REVISE, ev.VERIFY) and st.action == ev.NEW_TOPIC:
        st.action = ev.MATCH
        clamped.append("action")
        if st.taxonomy.need_memory != 1:
            st.taxonomy.need_memory = 1
            clamped.append("taxonomy.need_memory")
        if st.lens_recommendation != 3:
            st.lens_recommendation = 3
            clamped.append("lens_recommendation")
        if st.taxonomy.memory_span == ev.NONE:
            st.taxonomy.memory_span = ev.ACTIVE_THREAD
            clamped.append("taxonomy.memory_span")


# ---- Rule-based estimator -----------------------------------------------------------------------------


def _cue_regex(phrases: Sequence[str]) -> re.Pattern[str]:
    """Whole-word/phrase alternation; phrases ending in punctuation ('correct?') skip the end boundary."""
    parts = []
    for p in phrases:
        body = r"\s+".join(re.escape(w) for w in p.split())
        tail = r"\b" if p[-1].isalnum() else ""
        parts.append(rf"\b{body}{tail}")
    return re.compile("|".join(parts), re.IGNORECASE)


CUE_FAMILIES: dict[str, re.Pattern[str]] = {
    "revision": _cue_regex(
        [
            "revise",
            "revision",
            "change",
            "instead",
            "update",
            "fix",
            "modify",
            "rewrite",
            "make it",
            "shorter",
            "longer",
            "edit",
            "adjust",
            "tweak",
            "rephrase",
            "shorten",
            "replace",
        ]
    ),
    "finalization": _cue_regex(
        [
            "final",
            "finalize",
            "finalise",
            "summarize",
            "summarise",
            "summary",
            "wrap up",
            "put together",
            "overall",
            "recap",
            "in conclusion",
            "consolidate",
        ]
    ),
    "verification": _cue_regex(
        [
            "check",
            "verify",
            "correct?",
            "double-check",
            "double check",
            "confirm",
            "is that right",
            "is this right",
            "make sure",
        ]
    ),
    "constraint": _cue_regex(
        [
            "must",
            "should",
            "only",
            "at most",
            "at least",
            "budget",
            "under",
            "limit",
            "constraint",
            "no more than",
            "within",
            "maximum",
            "minimum",
        ]
    ),
    "temporal": _cue_regex(
        [
            "yesterday",
            "last week",
            "last month",
            "last year",
            "earlier",
            "before",
            "previously",
            "when did",
            "remember",
            "last time",
            "ago",
            "date",
            "recently",
        ]
    ),
    "quantity": _cue_regex(["how many", "how much", "number of", "total"]),
}
_PROACTIVE = _cue_regex(
    [
        "suggest",
        "suggestion",
        "suggestions",
        "idea",
        "ideas",
        "recommend",
        "recommendation",
        "recommendations",
        "any tips",
        "advice",
        "what should i",
    ]
)
_ANAPHORA = _cue_regex(["it", "that", "this", "those", "these"])
_RECENCY = _cue_regex(["recent", "recently", "latest", "last"])

# Token overlap with the active context above which a turn counts as a continuation even without cues.
CONTINUITY_OVERLAP = 0.2
# Cue families that mark a clear task state; their presence lowers ambiguity.
_STRONG_FAMILIES = ("revision", "finalization", "verification", "temporal")


def cue_flags(text: str) -> dict[str, bool]:
    """Every lexical cue the rules read, by name: the cue families, plus proactive requests, anaphora ("it",
    "that") and recency words (the learned controller takes them as features)."""
    flags = {name: bool(rx.search(text)) for name, rx in CUE_FAMILIES.items()}
    flags["proactive"] = bool(_PROACTIVE.search(text))
    flags["anaphora"] = bool(_ANAPHORA.search(text))
    flags["recency"] = bool(_RECENCY.search(text))
    return flags


def detect_cues(text: str) -> list[str]:
    """Cue families present in `text`, in the fixed order of CUE_FAMILIES (stable for logging)."""
    return [name for name, rx in CUE_FAMILIES.items() if rx.search(text)]


@dataclass(frozen=True)
class TurnEvidence:
    """What the rules read off a turn: its cue families and its lexical continuity with the active thread."""

    cues: frozenset[str]
    has_context: bool
    context_overlap: float
    #: A continuation of the active thread: a follow-up cue or enough shared vocabulary.
    is_match: bool

    @property
    def temporal(self) -> bool:
        return "temporal" in self.cues

    @property
    def continuous(self) -> bool:
        return self.context_overlap >= CONTINUITY_OVERLAP


@dataclass(frozen=True)
class MemoryBudget:
    """The retrieval side of the state: whether memory is used, where from, and how much."""

    need_memory: int
    scope: int
    span: int
    top_k: int
    lens: int
    prefer_recent: int


def read_evidence(text: str, active_context: Sequence[str]) -> TurnEvidence:
    cues = frozenset(detect_cues(text))
    has_context = any(c.strip() for c in active_context)
    context_overlap = overlap(text, "\n".join(active_context)) if has_context else 0.0
    followup_cue = bool(cues & {"revision", "finalization", "verification"}) or bool(_ANAPHORA.search(text))
    is_match = has_context and (followup_cue or context_overlap >= CONTINUITY_OVERLAP)
    return TurnEvidence(cues, has_context, context_overlap, is_match)


def _query_type(text: str, evidence: TurnEvidence) -> int:
    if evidence.temporal:
        return ev.TEMPORAL
    if _PROACTIVE.search(text):
        return ev.PROACTIVE
    return ev.DYNAMIC if evidence.is_match else ev.STATIC


def _phase(evidence: TurnEvidence) -> int:
    # REVISE/VERIFY only describe a continuation; on a new topic they would trip the clamp guardrail, so
    # there the next phases in priority order apply (the cue is still reported in risk_flags).
    cues = evidence.cues
    if evidence.is_match and "revision" in cues:
        return ev.REVISE
    if evidence.is_match and "verification" in cues:
        return ev.VERIFY
    if "finalization" in cues:
        return ev.SYNTHESIZE
    if "constraint" in cues:
        return ev.CONSTRAIN
    return ev.EXPLORE


def _memory_budget(text: str, evidence: TurnEvidence, query_type: int, phase: int) -> MemoryBudget:
    is_match, temporal = evidence.is_match, evidence.temporal
    # Paper B.2: revision/finalization evidence keeps memory on even when no active thread is visible
    # (e.g. "make it shorter" as the first turn of a new session refers to earlier sessions).
    refers_back = bool(evidence.cues & {"revision", "finalization"})
    self_contained = not is_match and query_type == ev.STATIC and not temporal and not refers_back
    need_memory = 0 if self_contained else 1
    scope = ev.GLOBAL if (query_type == ev.TEMPORAL or (not is_match and need_memory)) else ev.LOCAL
    if phase == ev.SYNTHESIZE or query_type == ev.TEMPORAL:
        top_k = 8
    elif is_match:
        top_k = 5
    else:
        top_k = 3
    prefer_recent = int(phase in (ev.REVISE, ev.VERIFY) or (temporal and bool(_RECENCY.search(text))))
    if need_memory == 0:
        span = ev.NONE
    elif scope == ev.GLOBAL:
        span = ev.CROSS_SESSION
    else:
        span = ev.ACTIVE_THREAD
    lens = 0 if need_memory == 0 else 3
    return MemoryBudget(need_memory, scope, span, top_k, lens, prefer_recent)


def _ambiguity(text: str, evidence: TurnEvidence) -> int:
    if len(tokenize(text)) < 3 and not evidence.has_context:
        return ev.HIGH
    return ev.LOW if evidence.cues & set(_STRONG_FAMILIES) else ev.MEDIUM


def _confidence(evidence: TurnEvidence, ambiguity: int) -> float:
    # Confidence grows with independent evidence (cue families, lexical continuity) and drops when unclear.
    confidence = 0.5 + 0.1 * len(evidence.cues) + (0.15 if evidence.continuous else 0.0)
    if ambiguity == ev.HIGH:
        confidence -= 0.2
    return round(min(0.95, max(0.05, confidence)), 4)


def _reason(evidence: TurnEvidence, query_type: int, phase: int, need_memory: int) -> str:
    if need_memory == 0:
        return "Self-contained new request; minimal memory view."
    if phase == ev.REVISE:
        return "Revision of the active artifact."
    if phase == ev.VERIFY:
        return "Verification of the active thread's content."
    if phase == ev.SYNTHESIZE:
        return "Synthesis over prior turns needs a rich memory view."
    if query_type == ev.TEMPORAL:
        return "Temporal recall needs cross-session evidence."
    if evidence.is_match:
        return "Continuation of the active thread."
    return "Topic shift that may draw on earlier sessions."


def estimate_state(text: str, active_context: Sequence[str]) -> ev.SessionState:
    """Deterministic QTM: lexical cues + topic continuity -> a valid SessionState (backend 'rules')."""
    evidence = read_evidence(text, active_context)
    query_type = _query_type(text, evidence)
    phase = _phase(evidence)
    budget = _memory_budget(text, evidence, query_type, phase)
    ambiguity = _ambiguity(text, evidence)
    raw = {
        "action": ev.Action.Name(ev.MATCH if evidence.is_match else ev.NEW_TOPIC),
        "query_type": ev.QueryType.Name(query_type),
        "phase": ev.Phase.Name(phase),
        "taxonomy": {
            "need_memory": budget.need_memory,
            "memory_span": ev.MemorySpan.Name(budget.span),
            "ambiguity": ev.Ambiguity.Name(ambiguity),
            "risk_flags": [name for name in CUE_FAMILIES if name in evidence.cues],
        },
        "lens_recommendation": budget.lens,
        "top_k_hint": budget.top_k,
        "prefer_recent": budget.prefer_recent,
        "retrieval_scope": ev.RetrievalScope.Name(budget.scope),
        "lens_confidence": _confidence(evidence, ambiguity),
        "lens_reason": _reason(evidence, query_type, phase, budget.need_memory),
    }
    state = clamp_state(raw)
    # The rules only emit allowed values, so any correction here is a bug in this module.
    if state.clamped_fields:
        raise AssertionError(f"rule-based QTM produced invalid fields: {list(state.clamped_fields)}")
    state.usage.backend = "rules"
    state.usage.llm_called = False
    state.usage.input_tokens = 0
    state.usage.output_tokens = 0
    state.usage.cost_usd = 0.0
    return state


def widen_session_opening(state: ev.SessionState) -> bool:
    """A session's first turn has no active thread inside the session (the labelling guide's consistency
    rule 4): a continuation that needs memory needs it from before the session, so CROSS_SESSION / GLOBAL.
    Applied to every backend's state for a turn that opens a session; True when it changed the state."""
    if state.action != ev.MATCH or not state.taxonomy.need_memory:
        return False
    if state.retrieval_scope == ev.GLOBAL and state.taxonomy.memory_span == ev.CROSS_SESSION:
        return False
    state.retrieval_scope = ev.GLOBAL
    state.taxonomy.memory_span = ev.CROSS_SESSION
    for name in ("retrieval_scope", "taxonomy.memory_span"):
        if name not in state.clamped_fields:
            state.clamped_fields.append(name)
    return True
