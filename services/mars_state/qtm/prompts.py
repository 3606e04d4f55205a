"""Versioned QTM prompt templates (paper Appendix B.2): PREVIOUS ACTIVE CONTEXT, NEW USER INPUT and
SYSTEM RULES, JSON only. `qtm-v1` is the default; `qtm-v1-reordered` and `qtm-v1-paraphrased` are the
instruction-reordered and paraphrased variants the sensitivity probe compares against it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROMPT_DIR = Path(__file__).parent / "prompts"
DEFAULT_PROMPT = "qtm-v1"
SYSTEM_ROLE = "You are a state controller. You output one JSON object and nothing else."
#: Longest active-context turn shown to the controller, in characters (keeps prompts inside small windows).
MAX_CONTEXT_CHARS = 600


def available_prompts() -> list[str]:
    return sorted(p.stem for p in PROMPT_DIR.glob("qtm-*.txt"))


@dataclass(frozen=True)
class PromptTemplate:
    version: str
    text: str
    rules: str

    @classmethod
    def load(cls, version: str = DEFAULT_PROMPT) -> PromptTemplate:
        """A template by version name (a file in the prompts folder) or by path to a template file."""
        path = Path(version)
        if not path.suffix:
            path = PROMPT_DIR / f"{version}.txt"
        if not path.is_file():
            raise ValueError(f"unknown QTM prompt {version!r}; available: {', '.join(available_prompts())}")
        # The system rules' version follows the template's major version (qtm-v1* -> system-rules-v1).
        major = path.stem.split("-")[1] if path.stem.count("-") >= 1 else "v1"
        rules_path = path.parent / f"system-rules-{major}.txt"
        if not rules_path.is_file():
            rules_path = PROMPT_DIR / "system-rules-v1.txt"
        return cls(path.stem, path.read_text(), rules_path.read_text().strip())

    def render(self, user_input: str, active_context: Sequence[str]) -> str:
        turns = [t.strip() for t in active_context if t.strip()]
        context = (
            "\n".join(f"{i}. {_clip(t)}" for i, t in enumerate(turns, 1))
            if turns
            else "(none: no active thread)"
        )
        return (
            self.text.replace("{{SYSTEM_RULES}}", self.rules)
            .replace("{{ACTIVE_CONTEXT}}", context)
            .replace("{{USER_INPUT}}", user_input.strip())
        )


def _clip(text: str) -> str:
    # Context turns are evidence for continuity, not content to answer: their heads carry the topic.
    return text if len(text) <= MAX_CONTEXT_CHARS else text[:MAX_CONTEXT_CHARS] + " ..."
