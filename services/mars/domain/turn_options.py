"""A turn's options (`TurnRequest.options`, carried on `TurnEvent.options`): one definition of the known keys
and their values, read by the ingress (to reject bad input before anything is written), by dispatch (which
acts on them) and by the HTTP gateway (which maps the OpenAI request onto them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The most answer tokens a turn may ask for.
MAX_TOKENS_LIMIT = 1024
#: The largest memory budget a turn may name (above any arm's window: the arm's own budget still applies).
VIEW_TOKENS_LIMIT = 1_000_000
KNOWN_OPTIONS = frozenset({"max_tokens", "stream", "remember", "view_tokens"})
_FLAGS = ("stream", "remember")


class InvalidOption(ValueError):
    """An option the caller got wrong; the message names it and says what is allowed."""


@dataclass(frozen=True)
class TurnOptions:
    #: Answer tokens (None: the dispatcher's default).
    max_tokens: int | None = None
    #: Stream partial answers (Converse).
    stream: bool = False
    #: Store the turn in memory (False: answered and logged, never stored).
    remember: bool = True
    #: Tokens the packed memory blocks may use at most (None: as many as the arm's input budget allows, Eq. 13).
    view_tokens: int | None = None


def _bounded_int(options: Mapping[str, str], key: str, limit: int) -> int | None:
    if key not in options:
        return None
    raw = options[key]
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= limit:
        raise InvalidOption(f"option {key} must be an integer in 1..{limit}")
    return int(raw)


def parse_turn_options(options: Mapping[str, str]) -> TurnOptions:
    """The typed options, or InvalidOption for an unknown key or a bad value."""
    unknown = sorted(set(options) - KNOWN_OPTIONS)
    if unknown:
        raise InvalidOption(
            f"unknown option(s) {', '.join(k[:40] for k in unknown)}; known: {', '.join(sorted(KNOWN_OPTIONS))}"
        )
    for flag in _FLAGS:
        if options.get(flag, "true") not in ("true", "false"):
            raise InvalidOption(f'option {flag} must be "true" or "false"')
    return TurnOptions(
        max_tokens=_bounded_int(options, "max_tokens", MAX_TOKENS_LIMIT),
        stream=options.get("stream") == "true",
        remember=options.get("remember") != "false",
        view_tokens=_bounded_int(options, "view_tokens", VIEW_TOKENS_LIMIT),
    )
