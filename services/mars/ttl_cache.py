"""A bounded cache whose entries expire a fixed time after they were read: what the services keep of a
table between reads (a tenant's budgets, its policy roles, its spend today), so each is read at most once
per TTL. The caller passes its clock's `now`, taken before the read, so an entry never outlives
`ttl_s` after the moment the data was current."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}

    def get(self, key: K, now: float) -> V | None:
        """The value, while fresh at `now`; None when absent or expired."""
        hit = self._entries.get(key)
        return hit[1] if hit is not None and hit[0] > now else None

    def put(self, key: K, value: V, now: float) -> None:
        """Keep `value` until `now` + ttl_s. When full, expired entries go first, then all of them."""
        if len(self._entries) >= self.max_entries:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
        self._entries[key] = (now + self.ttl_s, value)

    def pop(self, key: K) -> None:
        self._entries.pop(key, None)

    def drop(self, stale: Callable[[K], bool]) -> None:
        """Drop every entry whose key `stale` names (a forgotten user's, say)."""
        self._entries = {k: v for k, v in self._entries.items() if not stale(k)}

    def clear(self) -> None:
        self._entries.clear()
