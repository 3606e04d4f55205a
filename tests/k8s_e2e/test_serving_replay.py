"""Replay in the cluster: `mars deploy replay-job --apply` runs `mars replay read` beside the release, over
the topics every earlier test of the session wrote; the Job completes, and the summary in its log equals
the one `mars replay read` computes from outside the cluster over the same topics (no turn flows between
the two reads)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import IMAGE, NAMESPACE, RELEASE, REPORT, core, mars_cli
from mars_stack import kube, serving_cluster

pytestmark = pytest.mark.k8s_e2e

JOB = "mars-replay-e2e"


def summary_in(log: str) -> dict[str, Any]:
    """The JSON summary `mars replay read` prints (an indented object from a line "{" to a line "}")."""
    lines = log.splitlines()
    start = lines.index("{")
    end = lines.index("}", start)
    found: dict[str, Any] = json.loads("\n".join(lines[start : end + 1]))
    return found


def test_the_replay_job_reports_what_a_replay_from_outside_reports(
    serving: serving_cluster.ServingCluster, release: float, tmp_path: Path
) -> None:
    from kubernetes import client

    created = mars_cli(
        serving,
        "deploy", "replay-job", "--apply", "--release", RELEASE, "-n", NAMESPACE, "--image", IMAGE,
        "--name", JOB, "--", "read",
    )  # fmt: skip
    assert created.returncode == 0, created.stdout + created.stderr
    batch: Any = client.BatchV1Api(serving.cluster.api_client())

    def finished() -> str:
        job = batch.read_namespaced_job(JOB, NAMESPACE)
        conditions = {c.type for c in job.status.conditions or [] if c.status == "True"}
        return "Complete" if "Complete" in conditions else "Failed" if "Failed" in conditions else ""

    outcome = kube.wait_for(finished, 300, "the replay Job to finish")
    (pod,) = core(serving).list_namespaced_pod(NAMESPACE, label_selector=f"job-name={JOB}").items
    log = core(serving).read_namespaced_pod_log(pod.metadata.name, NAMESPACE)
    assert outcome == "Complete", log[-3000:]
    in_cluster = summary_in(log)

    out = tmp_path / "summary.json"
    host = mars_cli(serving, "replay", "read", "--bootstrap", serving.kafka_bootstrap, "--summary", str(out))
    assert host.returncode == 0, host.stdout + host.stderr
    outside = json.loads(out.read_text())
    assert in_cluster["turns"] > 0
    differing = differences(in_cluster, outside)
    REPORT.append(
        f"replay Job's report equals the host replay: {not differing} ({in_cluster['turns']} turn traces, "
        f"{in_cluster['complete']} complete; floats within a relative 1e-6)"
    )
    assert not differing, differing


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two summaries differ: counts and names exactly, floats within a relative 1e-6 (the two runs
    sum the same values in another order, on another build of numpy)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only on one side" for k in set(a) ^ set(b)]
        for key in sorted(set(a) & set(b)):
            out += differences(a[key], b[key], f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")
        ]
    if isinstance(a, float) or isinstance(b, float):
        ok = (
            isinstance(a, int | float)
            and isinstance(b, int | float)
            and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
        )
        return [] if ok else [f"{path}: {a!r} against {b!r}"]
    return [] if a == b else [f"{path}: {a!r} against {b!r}"]
