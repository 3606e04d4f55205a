"""The judge service's schema: the tables it owns, applied at its start and by `mars migrate` (a Helm hook)."""

from __future__ import annotations

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS judge_feedback (
        turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL,
        rating DOUBLE PRECISION NOT NULL, comment TEXT NOT NULL, received_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    # What each rewarded turn was rewarded with, so late feedback can move it by the difference once.
    """
    CREATE TABLE IF NOT EXISTS judge_rewards (
        turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL, arm TEXT NOT NULL,
        policy_id TEXT NOT NULL, judge_utility DOUBLE PRECISION NOT NULL, cost_usd DOUBLE PRECISION NOT NULL,
        lambda_cost DOUBLE PRECISION NOT NULL, applied_reward DOUBLE PRECISION NOT NULL,
        corrections INT NOT NULL DEFAULT 0
    )
    """,
    # Per-turn costs kept apart; totals per tenant and user are SUMs over this table (and OTel metrics).
    "ALTER TABLE judge_rewards ADD COLUMN IF NOT EXISTS controller_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0",
    "ALTER TABLE judge_rewards ADD COLUMN IF NOT EXISTS judge_cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0",
]
