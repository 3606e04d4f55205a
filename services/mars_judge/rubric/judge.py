"""The rubric judge (paper Eq. 17, Table 9, appendix B.5).

The deterministic judge (`mars.domain.reward.judge_turn`) always runs first: its signals (the answer's
use of the relevant memory, empty answer) are given to the LLM judge, and it is the answer whenever the
LLM judge is down, late or unparseable (`judge_fallback_reason` on the Judged event). Scores the LLM
leaves out or puts out of range are taken from, or clamped towards, the deterministic judge field by field,
so every judged turn carries a complete, valid rubric. The judge sees the query, the packed memory, the
state and the answer; never future turns or labels.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from mars import metrics
from mars.domain.reward import PROFILES, JudgeProfile, compose_utility, judge_turn
from mars.llm_json import EndpointError, JsonChatClient, NoJsonObject, TokenPrices, parse_json_object
from mars.v1 import events_pb2 as ev

PROMPT_DIR = Path(__file__).parent / "prompts"
SYSTEM_ROLE = "You are a turn judge. You output one JSON object and nothing else."
SCORE_FIELDS: tuple[str, ...] = tuple(f.name for f in ev.RubricScores.DESCRIPTOR.fields)
FLAG_FIELDS: tuple[str, ...] = tuple(f.name for f in ev.FailureFlags.DESCRIPTOR.fields)
#: Memory text shown to the judge, in characters (the judge needs the gist, not every block in full).
MAX_MEMORY_CHARS = 3000
MAX_ANSWER_CHARS = 3000


@functools.cache
def rubric_json_schema() -> dict[str, Any]:
    """Schema of one judgement, derived from the proto RubricScores / FailureFlags fields; within OpenAI's
    strict subset (`mars.llm_json.strict_schema_violations`)."""
    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "object",
                "properties": {f: {"type": "integer", "enum": [0, 1, 2, 3, 4, 5]} for f in SCORE_FIELDS},
                "required": list(SCORE_FIELDS),
                "additionalProperties": False,
            },
            "flags": {
                "type": "object",
                "properties": {f: {"type": "boolean"} for f in FLAG_FIELDS},
                "required": list(FLAG_FIELDS),
                "additionalProperties": False,
            },
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["scores", "flags", "confidence"],
        # Strict mode (OpenAI) rejects objects that allow extra keys; every object here is closed.
        "additionalProperties": False,
    }


#: Paper B.6: the online judge (GPT-4o-mini) at $0.15 in and $0.60 out per million tokens.
JUDGE_PRICES = TokenPrices(0.15, 0.60)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def render_prompt(template: str, generated: ev.Generated, signals: dict[str, Any], mode: str) -> str:
    memory = "\n---\n".join(b.text for b in generated.packed_blocks) or "(no memory was injected)"
    state = MessageToDict(generated.state, preserving_proto_field_name=True)
    state.pop("usage", None)
    state.pop("clamped_fields", None)
    return (
        template.replace("{{QUERY}}", generated.query.strip())
        .replace("{{MEMORY}}", _clip(memory, MAX_MEMORY_CHARS))
        .replace("{{STATE}}", json.dumps(state, sort_keys=True))
        .replace("{{ANSWER}}", _clip(generated.text.strip(), MAX_ANSWER_CHARS) or "(empty answer)")
        .replace("{{SIGNALS}}", json.dumps(signals, sort_keys=True))
        .replace("{{MODE}}", mode)
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class RubricJudge:
    def __init__(
        self,
        client: JsonChatClient | None,
        profile: str = "realmem",
        prompt: str = "judge-v1",
        deadline_s: float = 10.0,
        pricing: TokenPrices = JUDGE_PRICES,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown judge profile {profile!r}; known: {', '.join(PROFILES)}")
        path = PROMPT_DIR / f"{prompt}.txt" if not prompt.endswith(".txt") else Path(prompt)
        if not path.is_file():
            raise ValueError(f"unknown judge prompt {prompt!r} (no {path})")
        self.client = client
        self.profile_name = profile
        self.profile: JudgeProfile = PROFILES[profile]
        self.prompt_version = path.stem
        self._template = path.read_text()
        self.deadline_s = deadline_s
        self.pricing = pricing
        self.counts: Counter[str] = Counter()
        self._consecutive_failures = 0

    @property
    def healthy(self) -> bool:
        return self._consecutive_failures < 3

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        metrics.record_judge_outcome(outcome)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def score(self, generated: ev.Generated, lambda_cost: float) -> ev.Judged:
        judged = judge_turn(
            generated.query,
            generated.text,
            list(generated.packed_blocks),
            generated.state,
            generated.cost_usd,
            lambda_cost,
            self.profile,
        )
        judged.judge = "deterministic-v1"
        if self.client is None:
            self._count("deterministic")
            return judged
        if not generated.text.strip():
            # An empty answer has zero utility by definition; there is nothing for a judge to read.
            self._count("empty_answer")
            return judged
        signals = {
            "answer_use_of_relevant_memory": round(judged.coverage, 3),
            "answer_empty": not generated.text.strip(),
            "memory_blocks": len(generated.packed_blocks),
            "final_step": judged.final_step,
        }
        messages = [
            {"role": "system", "content": SYSTEM_ROLE},
            {"role": "user", "content": render_prompt(self._template, generated, signals, self.profile_name)},
        ]
        try:
            reply = await asyncio.wait_for(
                self.client.complete(messages, rubric_json_schema(), "turn_judgement"), self.deadline_s
            )
        except TimeoutError:
            return self._fallback(judged, "deadline")
        except EndpointError:
            return self._fallback(judged, "endpoint_error")
        self._consecutive_failures = 0
        judged.judge_input_tokens = reply.input_tokens
        judged.judge_output_tokens = reply.output_tokens
        judged.judge_cost_usd = self.pricing.cost(reply.input_tokens, reply.output_tokens)
        try:
            raw = parse_json_object(reply.text)
        except NoJsonObject:
            judged.judge_fallback_reason = "parse_error"
            self._count("parse_error")
            return judged
        self._apply(judged, raw, lambda_cost)
        judged.judge = f"rubric-{self.prompt_version}:{self.client.dialect}"
        return judged

    def _apply(self, judged: ev.Judged, raw: dict[str, Any], lambda_cost: float) -> None:
        """LLM scores and flags over the deterministic ones, field by field, then Eq. 17 again under the
        profile (MultiChallenge's M takes the LLM's revision application, and coverage as 1)."""
        scores: dict[str, Any] = raw["scores"] if isinstance(raw.get("scores"), dict) else {}
        flags: dict[str, Any] = raw["flags"] if isinstance(raw.get("flags"), dict) else {}
        repaired = 0
        for name in SCORE_FIELDS:
            value = _number(scores.get(name))
            if value is None:
                repaired += 1  # keep the deterministic score
                continue
            if not 0.0 <= value <= 5.0:
                repaired += 1
            setattr(judged.rubric, name, min(5.0, max(0.0, value)))
        for name in FLAG_FIELDS:
            flag = flags.get(name)
            if isinstance(flag, bool):
                setattr(judged.flags, name, flag)
            else:
                repaired += 1
        confidence = _number(raw.get("confidence"))
        judged.judge_confidence = min(1.0, max(0.0, confidence)) if confidence is not None else 0.5
        self._count("repaired" if repaired else "ok")
        m, a, q, p, u = compose_utility(
            judged.rubric, judged.flags, judged.coverage, judged.final_step, self.profile
        )
        judged.memory_component, judged.answer_component, judged.quality_component = m, a, q
        judged.penalty, judged.utility = p, u
        judged.reward = u - lambda_cost * judged.cost_usd

    def _fallback(self, judged: ev.Judged, reason: str) -> ev.Judged:
        self._consecutive_failures += 1
        self._count(reason)
        judged.judge_fallback_reason = reason
        return judged
