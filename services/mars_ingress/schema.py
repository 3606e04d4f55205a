"""The ingress service's schema: the tables it owns, applied at its start and by `mars migrate` (a Helm hook)."""

from __future__ import annotations

from mars import auth

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS ingress_user_seq (
        tenant TEXT NOT NULL, user_id TEXT NOT NULL, last_seq BIGINT NOT NULL,
        PRIMARY KEY (tenant, user_id)
    )
    """,
    # Every accepted turn is recorded with its outcome, so no turn is ever silently dropped.
    """
    CREATE TABLE IF NOT EXISTS ingress_turns (
        turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL, session_id TEXT NOT NULL,
        seq BIGINT NOT NULL, status TEXT NOT NULL, error TEXT,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now(), finished_at TIMESTAMPTZ
    )
    """,
    # When the caller stops waiting: a turn still PENDING past it lost its waiting replica (the reaper).
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS deadline_at TIMESTAMPTZ",
    "CREATE INDEX IF NOT EXISTS ingress_turns_pending ON ingress_turns (deadline_at) WHERE status = 'PENDING'",
    # The turn's received event (an outbox): a turn whose replica died before publishing it is sent again.
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS received BYTEA",
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS republished_at TIMESTAMPTZ",
    # A tenant's turns of today, for the daily spend limit (mars_ingress.quota.SPENT_TODAY_SQL).
    "CREATE INDEX IF NOT EXISTS ingress_turns_tenant_day ON ingress_turns (tenant, created_at)",
    # A user turn's content digest in its session (mars_ingress.history.text_digest): a turn's earlier messages
    # (TurnRequest.history) that MARS holds already are found by it and not stored again.
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS text_digest TEXT",
    "CREATE INDEX IF NOT EXISTS ingress_turns_text_digest ON ingress_turns (tenant, user_id, text_digest)",
    # When memory stored an imported pair (its MemoryCommitted event, which the outcome group reads): what
    # ImportHistory's wait counts, in the ingress's own table rather than memory's. Pairs imported before
    # the column existed were published to memory then: they are marked once, when the column is added.
    """
    DO $$
    BEGIN
        IF NOT EXISTS (
            SELECT 1 FROM information_schema.columns
            WHERE table_schema = current_schema() AND table_name = 'ingress_turns'
              AND column_name = 'memory_stored_at'
        ) THEN
            ALTER TABLE ingress_turns ADD COLUMN memory_stored_at TIMESTAMPTZ;
            UPDATE ingress_turns SET memory_stored_at = finished_at WHERE status = 'IMPORTED';
        END IF;
    END $$
    """,
    # What the turn cost (generator + controller + judge), from its Judged event (the outcome group): the
    # tenant's daily spend is summed here, in the ingress's own table, not the judge's (mars_ingress.quota).
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS cost_usd DOUBLE PRECISION",
    # Each owner's acknowledgement of a forget (mars.forget): every other service's role may insert its own
    # row and nothing else (mars.db_roles); ForgetUser waits for them.
    """
    CREATE TABLE IF NOT EXISTS ingress_forget_acks (
        forget_id TEXT NOT NULL, service TEXT NOT NULL, rows_deleted JSONB NOT NULL,
        acked_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (forget_id, service)
    )
    """,
    # Budgets per user and per API key (mars_ingress.budgets), beside the tenant's quotas: '*' is "not this
    # dimension". A row names a user or a key, never both; (tenant, '*', '*') only as the default for each
    # user (each_user). A NULL limit is no limit of that kind; a row holds at least one.
    """
    CREATE TABLE IF NOT EXISTS ingress_budgets (
        tenant TEXT NOT NULL, user_id TEXT NOT NULL DEFAULT '*', key_id TEXT NOT NULL DEFAULT '*',
        each_user BOOLEAN NOT NULL DEFAULT false,
        usd_per_day DOUBLE PRECISION CHECK (usd_per_day >= 0),
        tokens_per_minute BIGINT CHECK (tokens_per_minute >= 0),
        updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (tenant, user_id, key_id),
        CONSTRAINT ingress_budgets_one_dimension CHECK (user_id = '*' OR key_id = '*'),
        CONSTRAINT ingress_budgets_scope CHECK (each_user = (user_id = '*' AND key_id = '*')),
        CONSTRAINT ingress_budgets_a_limit CHECK (usd_per_day IS NOT NULL OR tokens_per_minute IS NOT NULL)
    )
    """,
    # The API key a turn came with (its id; NULL with auth off), and the tokens it counts against a
    # tokens-per-minute budget: its text's estimate when admitted, the answering call's prompt + answer
    # tokens once answered. Spend and tokens per user and per key are summed from here (mars_ingress.budget_store).
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS key_id TEXT",
    "ALTER TABLE ingress_turns ADD COLUMN IF NOT EXISTS tokens BIGINT",
    "CREATE INDEX IF NOT EXISTS ingress_turns_user_time ON ingress_turns (tenant, user_id, created_at)",
    "CREATE INDEX IF NOT EXISTS ingress_turns_key_time ON ingress_turns (tenant, key_id, created_at) "
    "WHERE key_id IS NOT NULL",
    # The API keys (mars.auth): applied with the ingress's schema, by the service and by `mars migrate`.
    *auth.MIGRATIONS,
]
