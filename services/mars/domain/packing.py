"""Model-specific packing of the candidate view into the generator prompt (paper Eq. 13, Fig. 5).

Runs after routing: the same candidate view is clipped differently for each arm's context budget, and again
for a fallback arm.

The system message is SYSTEM RULES, MEMORY GUIDANCE (the QTM state header) and MEMORY; without the state
header (`state_header=False`, dispatch's MARS_DISPATCH_STATE_HEADER=false: the paper's "No QTM state/header"
ablation, mars_semctx_noactive) it is SYSTEM RULES and MEMORY, with the same memory blocks and clipping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mars.domain.text import enum_name, estimate_tokens
from mars.v1 import events_pb2 as ev

# Per-message framing overhead (role markers, separators) added to the content token count.
MESSAGE_OVERHEAD_TOKENS = 4

SYSTEM_RULES = (
    "SYSTEM RULES\n"
    "You are a helpful assistant in a long-running conversation. Answer the user's current request directly. "
    "Use the memory below only where it is relevant; continue and edit existing work instead of restarting "
    "it, keep earlier constraints unless the user changes them, and do not invent past conversation that is "
    "not in memory."
)

_KIND_LABEL = {
    ev.ACTIVE_STATE: "Active thread state",
    ev.RECENT_TURN: "Recent turn",
    ev.RETRIEVED_HISTORY: "Retrieved from earlier conversations",
}


def input_budget(context_window: int, output_reserve: int, safety_margin: int) -> int:
    """B_in = W_ctx - R_out - M_safe (Eq. 13); a non-positive budget is a configuration error."""
    budget = context_window - output_reserve - safety_margin
    if budget <= 0:
        raise ValueError(
            f"input budget {budget} <= 0 (context_window={context_window}, "
            f"output_reserve={output_reserve}, safety_margin={safety_margin})"
        )
    return budget


@dataclass(frozen=True)
class PackedPrompt:
    """Chat messages for the generator plus what was kept and clipped."""

    messages: list[dict[str, str]]
    blocks: list[ev.MemoryBlock]
    prompt_tokens: int
    clipped_block_ids: list[str]
    fits: bool


def memory_guidance(state: ev.SessionState) -> str:
    """State header for the generator; internal scores, confidences and router terms stay out (Fig. 5)."""
    relation = "continuation of the active thread" if state.action == ev.MATCH else "topic shift"
    # Values this build has no name for (a newer producer, a foreign one) read as UNSPECIFIED.
    qtype = enum_name(ev.QueryType, state.query_type)
    phase = enum_name(ev.Phase, state.phase)
    scope = enum_name(ev.RetrievalScope, state.retrieval_scope)
    lens = "full memory view" if state.lens_recommendation == 3 else "minimal memory view"
    return (
        "MEMORY GUIDANCE\n"
        f"- Turn: {relation}\n"
        f"- Query type: {qtype}\n"
        f"- Phase: {phase}\n"
        f"- Retrieval scope: {scope}\n"
        f"- Prefer recent information: {'yes' if state.prefer_recent else 'no'}\n"
        f"- Memory lens: {lens}"
    )


def _memory_section(blocks: list[ev.MemoryBlock]) -> str:
    if not blocks:
        return "MEMORY\n(none)"
    return "MEMORY\n" + "\n\n".join(_block_text(b) for b in blocks)


def _head(guidance: str | None) -> str:
    """Everything of the system message before the memory section."""
    return f"{SYSTEM_RULES}\n\n{guidance}\n\n" if guidance is not None else f"{SYSTEM_RULES}\n\n"


def _messages(guidance: str | None, blocks: list[ev.MemoryBlock], query: str) -> list[dict[str, str]]:
    system = _head(guidance) + _memory_section(blocks)
    return [{"role": "system", "content": system}, {"role": "user", "content": query}]


def _block_text(block: ev.MemoryBlock) -> str:
    return f"[{_KIND_LABEL.get(block.kind, 'Memory')}]\n{block.text}"


class _PieceCounter:
    """Prompt tokens as the sum of its pieces' tokens (header, each block, separators, query), each piece
    counted once per pack: clipping a block subtracts its count instead of re-tokenizing the prompt. The
    sum can differ from tokenizing the joined text by about a token per boundary, which the budget's
    safety margin (Eq. 13) absorbs; with the conservative estimate it is an upper bound."""

    def __init__(
        self, guidance: str | None, blocks: list[ev.MemoryBlock], query: str, count: Callable[[str], int]
    ):
        self.header = count(_head(guidance) + "MEMORY\n")
        self.empty = count("(none)")
        self.separator = count("\n\n")
        self.blocks = [count(_block_text(b)) for b in blocks]
        self.query = count(query)

    def memory(self, kept: list[int]) -> int:
        """Tokens of the memory blocks alone (with their separators)."""
        return sum(self.blocks[i] for i in kept) + self.separator * max(0, len(kept) - 1)

    def total(self, kept: list[int]) -> int:
        memory = self.memory(kept) if kept else self.empty
        return self.header + memory + self.query + 2 * MESSAGE_OVERHEAD_TOKENS


def _drop_order(blocks: list[ev.MemoryBlock]) -> list[int]:
    """Block positions in clipping order: history lowest score first, then recent turns oldest first."""
    hist = [i for i, b in enumerate(blocks) if b.kind == ev.RETRIEVED_HISTORY]
    # Lower score drops first; among equal scores the later-ranked block (higher position) goes first.
    hist.sort(key=lambda i: (blocks[i].score, -i))
    recent = [i for i, b in enumerate(blocks) if b.kind == ev.RECENT_TURN]  # view order is oldest -> newest
    return hist + recent


def pack_view(
    view: ev.CandidateView,
    query: str,
    state: ev.SessionState,
    budget: int,
    count_tokens: Callable[[str], int] = estimate_tokens,
    state_header: bool = True,
    memory_budget: int | None = None,
) -> PackedPrompt:
    """Clip the candidate view to `budget` prompt tokens; active state and the query are never dropped.
    `state_header=False` leaves the MEMORY GUIDANCE header (the session state) out of the prompt.
    `memory_budget` also caps the memory blocks' own tokens (a turn's `view_tokens` option), clipped in
    the same order."""
    guidance = memory_guidance(state) if state_header else None
    blocks = list(view.blocks)
    counter = _PieceCounter(guidance, blocks, query, count_tokens)
    dropped: set[int] = set()
    kept_now = list(range(len(blocks)))
    tokens = counter.total(kept_now)
    for pos in _drop_order(blocks):
        if tokens <= budget and (memory_budget is None or counter.memory(kept_now) <= memory_budget):
            break
        dropped.add(pos)
        kept_now = [i for i in range(len(blocks)) if i not in dropped]
        tokens = counter.total(kept_now)
    kept = [b for i, b in enumerate(blocks) if i not in dropped]
    messages = _messages(guidance, kept, query)
    clipped = [blocks[i].block_id for i in _drop_order(blocks) if i in dropped]
    return PackedPrompt(
        messages=messages,
        blocks=kept,
        prompt_tokens=tokens,
        clipped_block_ids=clipped,
        fits=tokens <= budget,
    )
