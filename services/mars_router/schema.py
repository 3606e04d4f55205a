"""The router service's schema: the tables it owns, applied at its start and by `mars migrate` (a Helm hook)."""

from __future__ import annotations

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS router_policies (
        policy_id TEXT PRIMARY KEY, scope TEXT NOT NULL, dim INT NOT NULL,
        alpha DOUBLE PRECISION NOT NULL, ridge DOUBLE PRECISION NOT NULL, version BIGINT NOT NULL DEFAULT 0
    )
    """,
    # One row per arm: A, A^-1 and b packed as float64 bytes (see ArmModel.to_bytes).
    """
    CREATE TABLE IF NOT EXISTS router_arms (
        policy_id TEXT NOT NULL REFERENCES router_policies(policy_id), arm TEXT NOT NULL,
        model BYTEA NOT NULL, pulls BIGINT NOT NULL DEFAULT 0, reward_sum DOUBLE PRECISION NOT NULL DEFAULT 0,
        version BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (policy_id, arm)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS router_decisions (
        turn_id TEXT PRIMARY KEY, policy_id TEXT NOT NULL, arm TEXT NOT NULL,
        features DOUBLE PRECISION[] NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "ALTER TABLE router_decisions ADD COLUMN IF NOT EXISTS session_key TEXT",
    "CREATE INDEX IF NOT EXISTS router_decisions_session ON router_decisions (session_key, created_at)",
    # The applied-update ledger: at-least-once delivery, exactly-once effect.
    """
    CREATE TABLE IF NOT EXISTS router_ledger (
        turn_id TEXT PRIMARY KEY, policy_id TEXT NOT NULL, arm TEXT NOT NULL,
        reward DOUBLE PRECISION NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    # False: the reward was recorded while online updates were off (a frozen policy) and never applied.
    "ALTER TABLE router_ledger ADD COLUMN IF NOT EXISTS applied BOOLEAN NOT NULL DEFAULT true",
]
