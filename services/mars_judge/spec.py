"""The judge's spec (mars.spec): what the runtime, the launcher and the deployment know of it."""

from __future__ import annotations

from mars.config import JUDGE_STAGE, TOPIC_CONTROL, TOPIC_FEEDBACK, TOPIC_GENERATED, TOPIC_JUDGED
from mars.spec import ConsumerGroup, ServiceSpec, allow

from mars_judge.schema import MIGRATIONS
from mars_judge.settings import JudgeSettings

NAME = "judge"
#: Answers and the users' feedback: the rewards.
SCORES = ConsumerGroup("mars-judge", NAME, (TOPIC_GENERATED, TOPIC_FEEDBACK))

SPEC = ServiceSpec(
    NAME,
    JudgeSettings,
    tuple(MIGRATIONS),
    "mars.v1.Judge",
    (SCORES,),
    {"Score": allow("operator")},
    produces=(TOPIC_JUDGED,),
    broadcast_reads=(TOPIC_CONTROL,),
    stages=(JUDGE_STAGE,),
)
