"""mars.ttl_cache.TtlCache: what the ingress and the router keep of a table between reads."""

from __future__ import annotations

from mars.ttl_cache import TtlCache


def test_an_entry_is_served_until_its_ttl_from_the_read_then_missed() -> None:
    cache: TtlCache[str, bool] = TtlCache(0.5)
    cache.put("t", False, now=10.0)
    assert cache.get("t", now=10.0) is False  # a cached False is a hit, not a miss
    assert cache.get("t", now=10.49) is False
    assert cache.get("t", now=10.5) is None
    assert cache.get("other", now=10.0) is None


def test_a_full_cache_drops_expired_entries_first_then_everything() -> None:
    cache: TtlCache[int, int] = TtlCache(1.0, max_entries=3)
    cache.put(1, 1, now=0.0)
    cache.put(2, 2, now=5.0)
    cache.put(3, 3, now=5.0)
    cache.put(4, 4, now=5.5)  # full: 1 has expired and goes, 2 and 3 stay
    assert [cache.get(k, now=5.5) for k in (1, 2, 3, 4)] == [None, 2, 3, 4]
    cache.put(5, 5, now=5.6)  # full of fresh entries: all go
    assert [cache.get(k, now=5.6) for k in (2, 3, 4, 5)] == [None, None, None, 5]


def test_pop_drop_and_clear_forget_entries() -> None:
    cache: TtlCache[tuple[str, str], int] = TtlCache(60.0)
    for i, key in enumerate((("t", "ann"), ("t", "bob"), ("u", "ann"))):
        cache.put(key, i, now=0.0)
    cache.drop(lambda k: k[1] == "ann")
    assert [cache.get(k, now=1.0) for k in (("t", "ann"), ("t", "bob"), ("u", "ann"))] == [None, 1, None]
    cache.pop(("t", "bob"))
    cache.pop(("t", "bob"))  # absent: no error
    assert cache.get(("t", "bob"), now=1.0) is None
    cache.put(("x", "y"), 9, now=0.0)
    cache.clear()
    assert cache.get(("x", "y"), now=0.0) is None
