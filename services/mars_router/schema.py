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
    # Issue 47: what a decision was made by (its tenant, its policy version, the propensity of its arm) and the
    # cost weight of that version's reward (NULL: the judge's).
    "ALTER TABLE router_decisions ADD COLUMN IF NOT EXISTS tenant TEXT",
    "ALTER TABLE router_decisions ADD COLUMN IF NOT EXISTS config_version TEXT",
    "ALTER TABLE router_decisions ADD COLUMN IF NOT EXISTS propensity DOUBLE PRECISION",
    "ALTER TABLE router_decisions ADD COLUMN IF NOT EXISTS lambda_cost DOUBLE PRECISION",
    # Policy versions (mars.domain.policy_versions): immutable configs per tenant; a trigger refuses changes.
    """
    CREATE TABLE IF NOT EXISTS router_policy_versions (
        tenant TEXT NOT NULL, version TEXT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        algorithm TEXT NOT NULL CHECK (algorithm IN ('linucb', 'epsilon_greedy', 'thompson')),
        params JSONB NOT NULL, feature_set TEXT NOT NULL, lambda_cost DOUBLE PRECISION, arms TEXT[] NOT NULL,
        content_hash TEXT NOT NULL, note TEXT NOT NULL DEFAULT '', created_by TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (tenant, version), CHECK (version <> 'default'), CHECK (cardinality(arms) > 0)
    )
    """,
    # Created once, never replaced: a rerun of `mars migrate --roles` over a database made with one login
    # applies this as the router's role, which owns the table by then but not a function the admin made.
    """
    DO $$
    BEGIN
        IF to_regprocedure('router_policy_versions_immutable()') IS NULL THEN
            CREATE FUNCTION router_policy_versions_immutable() RETURNS trigger LANGUAGE plpgsql AS $f$
            BEGIN
                RAISE EXCEPTION 'policy version %/% is immutable: create a new version instead',
                    OLD.tenant, OLD.version USING ERRCODE = 'integrity_constraint_violation';
            END $f$;
        END IF;
        IF NOT EXISTS (
            SELECT 1 FROM pg_trigger
            WHERE tgname = 'router_policy_versions_immutable' AND tgrelid = 'router_policy_versions'::regclass
        ) THEN
            CREATE TRIGGER router_policy_versions_immutable BEFORE UPDATE OR DELETE ON router_policy_versions
            FOR EACH ROW EXECUTE FUNCTION router_policy_versions_immutable();
        END IF;
    END $$
    """,
    # Which version does what for a tenant: at most one per role (the primary key), so one live at most; a
    # tenant without a live row routes by the implicit version "default" (the router's settings).
    """
    CREATE TABLE IF NOT EXISTS router_policy_roles (
        tenant TEXT NOT NULL, role TEXT NOT NULL CHECK (role IN ('live', 'shadow', 'canary')),
        version TEXT NOT NULL, since TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (tenant, role), FOREIGN KEY (tenant, version) REFERENCES router_policy_versions (tenant, version)
    )
    """,
    # The audit trail: one row per create, activate, shadow, promote and rollback (rollback reads it back).
    """
    CREATE TABLE IF NOT EXISTS router_policy_changes (
        change_id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, action TEXT NOT NULL, role TEXT NOT NULL DEFAULT '',
        from_version TEXT, to_version TEXT, actor TEXT NOT NULL DEFAULT '',
        evidence JSONB NOT NULL DEFAULT '{}', changed_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX IF NOT EXISTS router_policy_changes_tenant ON router_policy_changes (tenant, change_id)",
    # The shadow's decision on each turn, beside the live one (never answered by): its matrices are
    # router_arms rows under the versioned policy id (mars_router.versions.versioned_policy_id).
    """
    CREATE TABLE IF NOT EXISTS router_shadow_decisions (
        turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, version TEXT NOT NULL, policy_id TEXT NOT NULL,
        arm TEXT NOT NULL, propensity DOUBLE PRECISION NOT NULL, score DOUBLE PRECISION NOT NULL,
        features DOUBLE PRECISION[] NOT NULL, lambda_cost DOUBLE PRECISION,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX IF NOT EXISTS router_shadow_decisions_version ON router_shadow_decisions (tenant, version)",
    # The canary run a decision was part of (NULL: none): its candidate version. The turn was the canary's
    # when config_version is this, live's otherwise (mars_router.rollouts).
    "ALTER TABLE router_decisions ADD COLUMN IF NOT EXISTS canary_version TEXT",
    # Canary runs (mars.domain.rollout): one per `mars policy canary`, its test's state updated in each judged
    # turn's transaction, decided once (promote, rollback, undecided, or stopped by an operator's change);
    # published_at: its PolicyDecision event is on mars.control. At most one open run per tenant.
    """
    CREATE TABLE IF NOT EXISTS router_rollouts (
        rollout_id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, live_version TEXT NOT NULL,
        candidate_version TEXT NOT NULL, started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        config JSONB NOT NULL DEFAULT '{}', state JSONB NOT NULL, turns BIGINT NOT NULL DEFAULT 0,
        decision TEXT, rule TEXT, evidence JSONB, decided_at TIMESTAMPTZ, published_at TIMESTAMPTZ,
        updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE UNIQUE INDEX IF NOT EXISTS router_rollouts_open ON router_rollouts (tenant) WHERE decided_at IS NULL",
]
