"""Deliberately broken copies of the code, each paired with the test that must catch it (issue 46: "show each
check failing on a deliberately broken copy").

A mutant is one textual edit of one file: `old` must occur exactly once there (tests/unit/test_sharpness.py
keeps the table from going stale as the code moves). `tests/sharpness/check_mutants.py` applies each edit
to a copy of the repository and runs the named test there; the check is sharp when that run fails (and,
with `--baseline`, the same test passes on the unbroken copy).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    #: What the test claims and the mutant breaks, in a few words.
    breaks: str
    path: str
    old: str
    new: str
    #: The pytest node id that must fail on the mutant.
    test: str
    #: unit: seconds; stack: starts a local stack (minutes); k8s: needs `make kube` (the Go-built control
    #: plane) and the chart on it (minutes).
    cost: str = "unit"


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="ngram-buckets-by-hash",
        breaks="the QTM's n-gram buckets are the same in every process (hash() is salted per process)",
        path="services/mars_state/qtm/learned.py",
        old='int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") % buckets',
        new="hash(g) % buckets",
        test="tests/unit/test_qtm_learned.py::"
        "test_ngram_buckets_are_the_same_in_every_process_and_carry_the_wording",
    ),
    Mutant(
        name="history-keys-by-hash",
        breaks="imported pairs keep their keys on a retry served by another process",
        path="services/mars_ingress/history.py",
        old="digest = hashlib.sha256(",
        new="digest = str(hash((turn.session_id, turn.user_text, turn.assistant_text))) or hashlib.sha256(",
        test="tests/unit/test_history.py::test_keys_are_stable_and_a_repeated_exchange_stays_two_pairs",
    ),
    Mutant(
        name="snapshots-in-hash-order",
        breaks="the QTM probe picks the same snapshots in every process",
        path="services/mars_tools/probe/qtm.py",
        old="for q in p.queries\n",
        new="for q in sorted(p.queries, key=lambda q: hash(q.query_id))\n",
        test="tests/unit/test_probe_qtm.py::test_snapshots_are_deterministic_and_bounded",
    ),
    Mutant(
        name="overhead-counts-the-model",
        breaks="the load harness's server overhead leaves the model call out (it lies inside the client's)",
        path="load-tests/decompose.py",
        old="return segments, dict(steps), (call.end - call.start) * 1000 - model_ms",
        new="return segments, dict(steps), (call.end - call.start) * 1000",
        test="tests/integration/test_load_short.py::test_load_short_run_measures_mars_and_litellm",
        cost="stack",
    ),
    Mutant(
        name="repeated-rating-corrects",
        breaks="a repeated rating moves nothing: the feedback test's positive marker sees an extra correction",
        path="services/mars_judge/service.py",
        old="if abs(delta) < 1e-12:",
        new="if abs(delta) < -1.0:",
        test="tests/integration/test_feedback.py::test_late_feedback_replaces_the_reward_by_the_difference_once",
        cost="stack",
    ),
    Mutant(
        name="log-mode-corrects",
        breaks="feedback in log mode is only recorded: the marker turn proves no correction came",
        path="services/mars_judge/service.py",
        old='if mode == "log":\n                return\n',
        new='if mode == "log":\n                mode = "replace"\n',
        test="tests/integration/test_feedback.py::test_blend_mode_and_log_mode",
        cost="stack",
    ),
    Mutant(
        name="view-drops-newest-pair",
        breaks="a turn that stays on its thread sees the pair its previous turn stored (read your writes)",
        path="services/mars/domain/memory_policy.py",
        old="window = list(recent)[-controls.recent_window :]",
        new="window = list(recent)[-controls.recent_window - 1 : -1]",
        test="tests/integration/test_pipeline.py::test_read_your_writes_view_includes_previous_turn",
        cost="stack",
    ),
    Mutant(
        name="master-key-hook-cannot-create",
        breaks="the master-key Job completes only when its pod really made the Secret",
        path="charts/mars/templates/master-key.yaml",
        old='resources: ["secrets"]\n    verbs: ["create"]',
        new='resources: ["secrets"]\n    verbs: ["list"]',
        test="tests/k8s/test_chart_on_cluster.py::"
        "test_install_without_a_gpu_node_leaves_vllm_pending_and_status_says_why",
        cost="k8s",
    ),
)
