"""Broker comparison on this machine: start time, produce-to-consume hop latency and consumer-group join
time, for Apache Kafka (KRaft) and Tansu, each started by the local stack launcher.

    .venv/bin/python load-tests/brokers.py [--hops 500] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: The hop topic, among the run's "mars." names (the tools' principal may use those alone on SASL_SSL).
HOPS = "mars.bench.hops"


async def measure(bootstrap: str, hops: int, fetch_max_wait_ms: int, idempotent: bool) -> dict[str, float]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from mars_stack import stack_kafka_options

    admin = AIOKafkaAdminClient(**stack_kafka_options(bootstrap))
    await admin.start()
    await admin.create_topics([NewTopic(HOPS, num_partitions=3, replication_factor=1)])
    await admin.close()
    producer = AIOKafkaProducer(**stack_kafka_options(bootstrap), acks="all", enable_idempotence=idempotent)
    await producer.start()
    consumer = AIOKafkaConsumer(
        HOPS,
        **stack_kafka_options(bootstrap),
        group_id="hops",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_wait_ms=fetch_max_wait_ms,
    )
    started = time.perf_counter()
    await consumer.start()
    while not consumer.assignment():
        await asyncio.sleep(0.01)
    join_s = time.perf_counter() - started
    lat = []
    for i in range(hops):
        t = time.perf_counter()
        await producer.send_and_wait(HOPS, b"x", key=f"user{i % 50}".encode())
        while not await consumer.getmany(timeout_ms=1000):
            pass
        lat.append(time.perf_counter() - t)
    await consumer.stop()
    await producer.stop()
    lat.sort()
    return {
        "group_join_s": join_s,
        "hop_p50_ms": 1000 * lat[len(lat) // 2],
        "hop_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hops", type=int, default=500)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO / "infra"), str(REPO / "services")]
    from mars_stack import LocalStack, StackSettings

    rows: list[dict[str, Any]] = []
    for broker in ("kafka", "tansu"):
        started = time.perf_counter()
        stack = LocalStack(
            StackSettings(broker=broker, start_llm=False, start_postgres=False, services=(), supervise=False)
        ).start()
        start_s = time.perf_counter() - started
        try:
            wait_ms = int(stack.env.get("MARS_KAFKA_FETCH_MAX_WAIT_MS", "500"))
            idempotent = stack.env["MARS_KAFKA_IDEMPOTENCE"] == "true"
            row = {
                "broker": broker,
                "start_s": start_s,
                "fetch_max_wait_ms": wait_ms,
                "idempotent": idempotent,
            }
            row.update(
                asyncio.run(measure(stack.env["MARS_KAFKA_BOOTSTRAP"], args.hops, wait_ms, idempotent))
            )
            rows.append(row)
        finally:
            stack.stop()
    print(f"{'broker':8s} {'start s':>8s} {'join s':>7s} {'hop p50 ms':>11s} {'hop p99 ms':>11s}")
    for r in rows:
        print(
            f"{r['broker']:8s} {r['start_s']:8.2f} {r['group_join_s']:7.2f} {r['hop_p50_ms']:11.2f} "
            f"{r['hop_p99_ms']:11.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
