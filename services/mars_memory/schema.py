"""The memory service's schema: the tables it owns, applied at its start and by `mars migrate` (a Helm hook)."""

from __future__ import annotations

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS memory_threads (
        thread_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL,
        status TEXT NOT NULL, opened_seq BIGINT NOT NULL, title TEXT NOT NULL,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX IF NOT EXISTS memory_threads_user ON memory_threads (tenant, user_id, status)",
    """
    CREATE TABLE IF NOT EXISTS memory_records (
        record_id TEXT PRIMARY KEY, turn_id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL, user_id TEXT NOT NULL, session_id TEXT NOT NULL, thread_id TEXT NOT NULL,
        seq BIGINT NOT NULL, user_text TEXT NOT NULL, assistant_text TEXT NOT NULL,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX IF NOT EXISTS memory_records_user ON memory_records (tenant, user_id, seq)",
    # The active-thread state (subject, constraints, latest artifact version) as JSON.
    "ALTER TABLE memory_threads ADD COLUMN IF NOT EXISTS state JSONB",
    # Chunk vectors (float32, one row per piece) beside the text, so indexes rebuild without re-embedding.
    "ALTER TABLE memory_records ADD COLUMN IF NOT EXISTS embedding BYTEA",
    "ALTER TABLE memory_records ADD COLUMN IF NOT EXISTS embedding_model TEXT",
    """
    CREATE TABLE IF NOT EXISTS memory_progress (
        tenant TEXT NOT NULL, user_id TEXT NOT NULL, applied_seq BIGINT NOT NULL,
        PRIMARY KEY (tenant, user_id)
    )
    """,
    # Commit order of the records: a user's commits are serialised (advisory lock), so per user it only
    # grows; an index holds every record up to its watermark and catches up with `commit_no > watermark`.
    "ALTER TABLE memory_records ADD COLUMN IF NOT EXISTS commit_no BIGSERIAL",
    "CREATE INDEX IF NOT EXISTS memory_records_commit ON memory_records (tenant, user_id, commit_no)",
]
