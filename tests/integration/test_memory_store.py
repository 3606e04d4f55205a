"""The memory store against a real Postgres and real FAISS / MiniLM (no broker needed)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import session_state
from mars import db
from mars.retrieval.embedder import SentenceTransformerEmbedder
from mars.v1 import events_pb2 as ev
from mars_memory.schema import MIGRATIONS
from mars_memory.settings import MemorySettings
from mars_memory.store import MemoryStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


def generated(
    user: str, seq: int, query: str, answer: str, action: int = ev.MATCH, session: str = "s"
) -> ev.Generated:
    return ev.Generated(
        turn=ev.TurnEnvelope(
            turn_id=f"{user}-{seq}", tenant="t", user_id=user, session_id=session, seq=seq, schema_version=1
        ),
        status=ev.OK,
        model="m",
        text=answer,
        query=query,
        state=session_state(action=action),
    )


async def make_store(
    dsn: str, embedder: SentenceTransformerEmbedder, **kw: object
) -> tuple[MemoryStore, object]:
    pool = await db.open_pool(dsn)
    await db.migrate(pool, "memory", MIGRATIONS)
    return MemoryStore(pool, MemorySettings(postgres_dsn=dsn, **kw), embedder), pool  # type: ignore[arg-type]


ALICE = [
    ("I keep bees in my garden and want to harvest honey", "Harvest when frames are capped."),
    ("What about moving the beehive before winter?", "Move it at night, a short distance."),
    ("Now a new question: how do I repot a fern?", "Use peat-free compost."),
]
BOB = [
    ("Teach me to play chess openings", "Start with the Italian game."),
    ("My honey cake recipe needs less sugar", "Swap half the sugar for applesauce."),
]


def test_views_isolate_users_and_survive_a_rebuild(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder)
        for i, (q, a) in enumerate(ALICE, start=1):
            await store.commit(generated("alice", i, q, a, ev.NEW_TOPIC if i in (1, 3) else ev.MATCH))
        for i, (q, a) in enumerate(BOB, start=1):
            await store.commit(generated("bob", i, q, a, ev.NEW_TOPIC))
        probe = session_state(action=ev.NEW_TOPIC, query_type=ev.TEMPORAL, top_k_hint=8)
        before = await store.view("t", "alice", "when should I harvest honey from the beehive?", probe)
        texts = [b.text for b in before.blocks]
        assert texts and all("chess" not in t and "honey cake" not in t for t in texts)
        hist = [b for b in before.blocks if b.kind == ev.RETRIEVED_HISTORY]
        assert "bees" in hist[0].text  # the beekeeping record ranks first
        await pool.close()  # type: ignore[attr-defined]

        # A new store (a restarted service) rebuilds its indexes from Postgres: same view.
        store2, pool2 = await make_store(postgres, embedder)
        after = await store2.view("t", "alice", "when should I harvest honey from the beehive?", probe)
        assert [b.block_id for b in after.blocks] == [b.block_id for b in before.blocks]
        assert [b.score for b in after.blocks] == pytest.approx([b.score for b in before.blocks], abs=1e-6)
        assert (
            await store2.view("t", "nobody", "anything at all", probe)
        ).blocks == []  # unknown user: empty view
        await pool2.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_forgetting_a_user_drops_their_query_vectors_on_every_replica(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    """Also where the user's index is not loaded (another replica, or an index evicted) and for a query
    that left no record: the cached vectors of a forgotten user's texts are gone either way."""

    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder)
        await store.commit(generated("dora", 1, "My knee hurts after running", "Rest it for a few days."))
        probe = session_state(action=ev.NEW_TOPIC, top_k_hint=4)
        await store.view("t", "dora", "a private question about my rash", probe)  # asked, never stored
        cache = store.embedding.query_embedder
        assert cache is not None and "a private question about my rash" in cache._cache
        store.indexes.pop("t", "dora")  # as on a replica that never loaded dora's index
        await store.forget("t", "dora")
        assert "a private question about my rash" not in cache._cache
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_table6_rows_produce_their_blocks(postgres: str, embedder: SentenceTransformerEmbedder) -> None:
    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder)
        for i, (q, a) in enumerate(ALICE, start=1):
            await store.commit(generated("carol", i, q, a, ev.NEW_TOPIC if i in (1, 3) else ev.MATCH))

        def kinds(view: ev.CandidateView) -> list[int]:
            return [b.kind for b in view.blocks]

        # need_memory=0 / lens 0: no active state, at most a short window, no retrieval.
        minimal = await store.view(
            "t", "carol", "what is 2+2?", session_state(need_memory=0, lens_recommendation=0)
        )
        assert ev.ACTIVE_STATE not in kinds(minimal) and ev.RETRIEVED_HISTORY not in kinds(minimal)
        assert len(minimal.blocks) <= 1
        # MATCH + LOCAL: active state and recent turns, no historical retrieval.
        local = await store.view("t", "carol", "use a bigger pot?", session_state(retrieval_scope=ev.LOCAL))
        assert kinds(local)[0] == ev.ACTIVE_STATE and ev.RECENT_TURN in kinds(local)
        active_text = local.blocks[0].text
        assert active_text.startswith("Active thread: Now a new question: how do I repot a fern?")
        assert "Latest version (v1):\nUse peat-free compost." in active_text
        assert ev.RETRIEVED_HISTORY not in kinds(local)
        # GLOBAL: ranked candidates from earlier threads, never the recent window again.
        glob = await store.view(
            "t", "carol", "the beehive again", session_state(retrieval_scope=ev.GLOBAL, top_k_hint=3)
        )
        hist = [b for b in glob.blocks if b.kind == ev.RETRIEVED_HISTORY]
        recent = {b.source_turn_id for b in glob.blocks if b.kind == ev.RECENT_TURN}
        assert hist and len(hist) <= 3 and not recent & {b.source_turn_id for b in hist}
        # top_k_hint=8 (richest lens): more history than the hint-3 view.
        rich = await store.view(
            "t", "carol", "the beehive again", session_state(retrieval_scope=ev.GLOBAL, top_k_hint=8)
        )
        assert len([b for b in rich.blocks if b.kind == ev.RETRIEVED_HISTORY]) >= len(hist)
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_the_logged_ranking_covers_all_memory_whatever_the_controls(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder)
        for i, ((q, a), session) in enumerate(zip(ALICE, ("bees", "bees", "fern"), strict=True), start=1):
            await store.commit(generated("erin", i, q, a, ev.NEW_TOPIC if i in (1, 3) else ev.MATCH, session))
        text = "when do I harvest the honey from my beehive?"
        # LOCAL scope: the view keeps to the active thread (the fern), the ranking covers all memory,
        # one entry per session, best first.
        local = await store.view("t", "erin", text, session_state(retrieval_scope=ev.LOCAL), "now")
        shown = {b.source_session_id for b in local.blocks if b.kind == ev.RETRIEVED_HISTORY}
        assert shown <= {"fern"}
        assert [r.session_id for r in local.ranking] == ["bees", "fern"]
        assert local.ranking[0].score > 0
        # No memory needed: nothing retrieved into the view, the same ranking logged.
        bare = await store.view("t", "erin", text, session_state(need_memory=0, lens_recommendation=0), "now")
        assert not [b for b in bare.blocks if b.kind == ev.RETRIEVED_HISTORY]
        assert [(r.session_id, r.record_id) for r in bare.ranking] == [("bees", ""), ("fern", "")]
        # The GLOBAL view ranked records: each session comes with its best one.
        best = await store.view("t", "erin", text, session_state(), "now")
        assert best.ranking[0].record_id in (await store.describe("t", "erin")).record_ids[:2]
        # The turn's own session is left out.
        own = await store.view("t", "erin", text, session_state(), "bees")
        assert [r.session_id for r in own.ranking] == ["fern"]
        await pool.close()  # type: ignore[attr-defined]
        off, pool2 = await make_store(postgres, embedder, view_ranking_depth=0)
        assert not (await off.view("t", "erin", text, session_state(), "now")).ranking
        await pool2.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_read_your_writes_under_out_of_order_arrival(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder, read_your_writes_wait_s=5.0)
        await store.commit(generated("dave", 1, "I am learning to bake sourdough", "Feed the starter daily."))

        # The view for turn 3 arrives before turn 2 is applied: it must wait, then see turn 2.
        async def late_commit() -> None:
            await asyncio.sleep(0.5)
            await store.commit(
                generated("dave", 2, "My sourdough starter smells of acetone", "Feed it more often.")
            )

        t0 = time.monotonic()
        waiter = asyncio.create_task(store.wait_applied("t", "dave", 2))
        await late_commit()
        assert await waiter is True
        assert time.monotonic() - t0 >= 0.5
        view = await store.view(
            "t", "dave", "what did you say about the acetone smell?", session_state(retrieval_scope=ev.GLOBAL)
        )
        assert "dave-2" in {b.source_turn_id for b in view.blocks}

        # Turn 4 is never applied: the bounded wait gives up (the view would be flagged possibly_stale).
        store_fast, pool_fast = await make_store(postgres, embedder, read_your_writes_wait_s=0.3)
        assert await store_fast.wait_applied("t", "dave", 4) is False
        # Another user's commit of that seq, here, satisfies nobody else's wait.
        waited, _ = await asyncio.gather(
            store_fast.wait_applied("t", "dave", 4),
            store_fast.commit(generated("erin", 4, "Plan a picnic", "Bring a blanket.")),
        )
        assert waited is False
        assert await store_fast.wait_applied("t", "erin", 4) is True
        await pool.close()  # type: ignore[attr-defined]
        await pool_fast.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_store_without_embedder_serves_lexical_views(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder)
        for i, (q, a) in enumerate(ALICE, start=1):
            await store.commit(generated("erin", i, q, a, ev.NEW_TOPIC if i in (1, 3) else ev.MATCH))
        degraded, pool2 = await make_store(postgres, None)  # type: ignore[arg-type]
        assert not degraded.dense_available
        view = await degraded.view(
            "t", "erin", "harvest honey from the bees", session_state(action=ev.NEW_TOPIC)
        )
        hist = [b for b in view.blocks if b.kind == ev.RETRIEVED_HISTORY]
        assert hist and "bees" in hist[0].text
        # A record written while degraded has no vector; a healthy store re-embeds it on rebuild.
        await degraded.commit(generated("erin", 4, "Should I feed the bees sugar syrup?", "Yes, in autumn."))
        healthy, pool3 = await make_store(postgres, embedder)
        view = await healthy.view("t", "erin", "sugar syrup for bees", session_state(action=ev.NEW_TOPIC))
        assert "erin-4" in {b.source_turn_id for b in view.blocks}
        for p in (pool, pool2, pool3):
            await p.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_fusion_settings_come_from_config(postgres: str, embedder: SentenceTransformerEmbedder) -> None:
    async def scenario() -> None:
        store, pool = await make_store(postgres, embedder, fusion={"fusion": "weighted", "dense_weight": 2.0})
        assert store.views.config.fusion == "weighted" and store.views.config.dense_weight == 2.0
        with pytest.raises(TypeError):
            await make_store(postgres, embedder, fusion={"no_such_knob": 1.0})
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_a_replica_serves_views_for_writes_another_replica_applied(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    """Two stores on one Postgres, as two memory replicas: `writer` applies every write, `reader` only
    builds views. The reader's index follows the table by commit watermark, so each view sees the turn
    before it, and its index equals a rebuild from Postgres after every write (no stale cache)."""

    async def scenario() -> None:
        writer, wpool = await make_store(postgres, embedder)
        reader, rpool = await make_store(postgres, embedder, replica="memory-2")
        user = "replica-user"
        try:
            facts = [
                ("My ferry to the island leaves from pier 4 at 7:15", "Noted: pier 4, 7:15."),
                ("I also need a dentist appointment on Friday", "Noted: dentist Friday."),
                ("Remind me what time my ferry leaves", "Pier 4 at 7:15."),
            ]
            for seq, (query, answer) in enumerate(facts, start=1):
                # The reader builds a view before each write too, so its index is loaded and cached: the
                # writes after that must still reach it.
                await reader.view("t", user, query, session_state())
                await writer.commit(generated(user, seq, query, answer))
                assert await reader.wait_applied("t", user, seq)
                view = await reader.view("t", user, "when does the ferry leave?", session_state())
                shown = {b.source_turn_id for b in view.blocks}
                assert f"{user}-{seq}" in shown, (seq, shown)
                described = await reader.describe("t", user)
                rebuilt = await _rebuild(postgres, embedder, user)
                assert list(described.record_ids) == rebuilt.order
                assert described.dense_vectors == rebuilt.memory.dense_vectors > 0
                assert described.lexical_docs == seq
                assert described.replica == "memory-2"
        finally:
            await wpool.close()  # type: ignore[attr-defined]
            await rpool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


async def _rebuild(dsn: str, embedder: SentenceTransformerEmbedder, user: str):  # type: ignore[no-untyped-def]
    """A fresh store's index of the user: what Postgres holds, built from nothing."""
    store, pool = await make_store(dsn, embedder)
    try:
        index = await store.user_index("t", user)
        async with index.lock:
            await store.catch_up("t", user, index)
        return index
    finally:
        await pool.close()  # type: ignore[attr-defined]


class GatedEmbedder:
    """The real embedder, holding back every text that names the gate's word until the gate opens (a
    stored pair's embedding that takes its time)."""

    def __init__(self, inner: SentenceTransformerEmbedder, word: str) -> None:
        self.inner, self.word, self.dim = inner, word, inner.dim
        self.gate = threading.Event()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if any(self.word in t for t in texts):
            assert self.gate.wait(30), "the gate never opened"
        return self.inner.encode(texts)


async def _settled(store: MemoryStore) -> None:
    """Until the store's write-behind has stored every pair it took."""
    for _ in range(100):
        if store.embedding.write_behind is None or store.embedding.write_behind.backlog == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the write-behind never caught up")


async def _stored_vectors(pool: object, turn_id: str) -> tuple[object, object]:
    async with pool.connection() as conn:  # type: ignore[attr-defined]
        cur = await conn.execute(
            "SELECT embedding, embedding_model FROM memory_records WHERE turn_id = %s", (turn_id,)
        )
        row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_pair_is_applied_before_its_embedding_and_the_next_view_still_holds_it(
    postgres: str, embedder: SentenceTransformerEmbedder
) -> None:
    """The write path never delays the view path (mars_memory.write_behind): a commit applies its pair
    without waiting for the pair's embedding, and the user's next view holds the pair, ranked with the
    vectors that an embedding in the commit gives (read-your-writes stays exact)."""

    async def scenario() -> None:
        gated = GatedEmbedder(embedder, "saffron")
        store, pool = await make_store(postgres, gated)  # type: ignore[arg-type]
        await store.commit(generated("fay", 1, "How deep do I plant tulip bulbs?", "About 15 cm deep."))
        await _settled(store)
        first = generated("fay", 2, "I grow saffron crocuses on my balcony", "Harvest the red stigmas.")
        # The gate is shut: an embedding in the commit would hang it; behind it, the commit is done.
        committed = await asyncio.wait_for(store.commit(first), timeout=5)
        assert committed.stored and await store.wait_applied("t", "fay", 2)
        assert await _stored_vectors(pool, "fay-2") == (None, None)
        assert store.embedding.write_behind is not None and store.embedding.write_behind.backlog == 1

        probe = session_state(action=ev.NEW_TOPIC, top_k_hint=4)
        view = asyncio.create_task(store.view("t", "fay", "when do crocuses flower?", probe))
        await asyncio.sleep(0.3)
        assert not view.done()  # it waits for the pair's vectors, not for nothing
        gated.gate.set()
        held = await asyncio.wait_for(view, timeout=30)
        assert "fay-2" in {b.source_turn_id for b in held.blocks}
        await _settled(store)  # stored just after the view had them
        blob, model = await _stored_vectors(pool, "fay-2")
        assert blob is not None and model == store.embedding.model_name

        # The same records embedded in their commits: the same view, the same scores.
        inline, pool2 = await make_store(postgres, embedder, embed_behind=0)
        assert inline.embedding.write_behind is None
        await inline.commit(generated("gus", 1, "How deep do I plant tulip bulbs?", "About 15 cm deep."))
        await inline.commit(
            generated("gus", 2, "I grow saffron crocuses on my balcony", "Harvest the red stigmas.")
        )
        assert (await _stored_vectors(pool2, "gus-2"))[0] is not None  # in the commit
        same = await inline.view("t", "gus", "when do crocuses flower?", probe)
        assert [b.source_turn_id.replace("gus", "fay") for b in same.blocks] == [
            b.source_turn_id for b in held.blocks
        ]
        assert [b.score for b in same.blocks] == pytest.approx([b.score for b in held.blocks], abs=1e-5)
        await pool.close()  # type: ignore[attr-defined]
        await pool2.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_the_write_behind_lag_is_bounded(postgres: str, embedder: SentenceTransformerEmbedder) -> None:
    """With `embed_behind` pairs waiting, the next commit embeds its own pair before it applies it."""

    async def scenario() -> None:
        gated = GatedEmbedder(embedder, "quince")
        store, pool = await make_store(postgres, gated, embed_behind=1)  # type: ignore[arg-type]
        try:
            await store.commit(generated("hal", 0, "Should I prune roses in March?", "Yes, lightly."))
            await _settled(store)
            await asyncio.wait_for(
                store.commit(generated("hal", 1, "Is quince jelly hard to make?", "Not at all.")), 5
            )
            assert store.embedding.write_behind is not None and store.embedding.write_behind.full
            await store.commit(generated("hal", 2, "What goes with roast lamb?", "Mint sauce."))
            assert (await _stored_vectors(pool, "hal-2"))[0] is not None  # embedded in its commit
            assert (await _stored_vectors(pool, "hal-1"))[0] is None  # still behind
        finally:
            gated.gate.set()
            await pool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())
