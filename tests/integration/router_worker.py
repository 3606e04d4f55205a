"""A separate router process for the concurrency test: applies the rewards it is given to one policy."""

import asyncio
import json
import sys

from mars import db
from mars_router.schema import MIGRATIONS
from mars_router.settings import RouterSettings
from mars_router.store import PolicyStore


async def main(dsn: str, jobs: list[list[object]], arms: list[str]) -> None:
    pool = await db.open_pool(dsn)
    await db.migrate(pool, "router", MIGRATIONS)
    store = PolicyStore(pool, RouterSettings(postgres_dsn=dsn, policy_scope="global"), arms)
    for turn_id, arm, reward in jobs:
        await store.apply_reward(str(turn_id), str(arm), float(reward), [])  # type: ignore[arg-type]
    # Optimistic conflicts this process retried (the test reads it from stdout).
    print(json.dumps({"update_conflicts": store.rewards.update_conflicts}))
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])))
