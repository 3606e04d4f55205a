"""The stack's tenants: a tenant and its API key in the ingress's schema, so that the demo, `mars send` and
the tests can call the ingress as a client does."""

from __future__ import annotations


def create_tenant(dsn: str, tenant: str, *, apply_schema: bool) -> str:
    """Issue an API key for `tenant` and return it. `apply_schema`: apply the ingress schema first (the one
    `mars migrate` and the ingress apply, API keys included); a stack with a role per service applied every
    schema already."""
    import asyncio

    import psycopg
    from mars import auth
    from mars.migrations import migrate_all

    if apply_schema:
        asyncio.run(migrate_all(dsn, ("ingress",)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        key = auth.issue(conn, tenant, label="local stack")
    return key.key
