"""The state service's schema: the tables it owns, applied at its start and by `mars migrate` (a Helm hook)."""

from __future__ import annotations

MIGRATIONS = [
    # The active context the controller reads: the user turns of the active thread, newest last.
    """
    CREATE TABLE IF NOT EXISTS state_context (
        tenant TEXT NOT NULL, user_id TEXT NOT NULL,
        recent_texts JSONB NOT NULL, thread_depth INT NOT NULL, last_seq BIGINT NOT NULL,
        PRIMARY KEY (tenant, user_id)
    )
    """,
    # The session of the last turn: the next turn in another session opens it (mars_state.qtm.guard).
    "ALTER TABLE state_context ADD COLUMN IF NOT EXISTS session_id TEXT",
]
