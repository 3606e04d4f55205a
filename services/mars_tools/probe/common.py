"""What the QTM probes and `mars train qtm` share: controller configurations, the local LLM server for them,
RealMem persona files and project-session boundaries, and the scores."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.llm_json import endpoint_url
from mars_state.qtm.controllers import BACKENDS, make_controller
from mars_state.qtm.guard import GuardedEstimator
from rich.console import Console

from mars_tools.bench.realmem import persona_name_from_path

#: Earlier user turns of the session shown as active context (the state service's default).
CONTEXT_TURNS = 6

CONFIG_HELP = (
    "controller config: 'rules', or key=value pairs backend=rules|openai|llamacpp|vllm, prompt=VERSION, "
    "url=BASE_URL, model=NAME, deadline_ms=N (llamacpp without url starts the local llama.cpp server)"
)


@dataclass(frozen=True)
class ControllerConfig:
    """`rules`, or `backend=llamacpp,prompt=qtm-v1-reordered[,url=...,model=...,deadline_ms=...]`."""

    backend: str = "rules"
    prompt: str = "qtm-v1"
    url: str = ""
    model: str = ""
    deadline_ms: int = 120_000

    @classmethod
    def parse(cls, spec: str) -> ControllerConfig:
        if "=" not in spec:
            return cls(backend=spec.strip())
        fields: dict[str, Any] = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in ("backend", "prompt", "url", "model", "deadline_ms"):
                raise ValueError(f"unknown controller setting {key!r} in {spec!r}")
            fields[key] = int(value) if key == "deadline_ms" else value.strip()
        config = cls(**fields)
        if config.backend not in BACKENDS:
            raise ValueError(f"unknown QTM backend {config.backend!r}; known: {', '.join(BACKENDS)}")
        return config

    def label(self) -> str:
        # Rules and the learned model take no prompt.
        return self.backend if self.backend in ("rules", "learned") else f"{self.backend}:{self.prompt}"

    def estimator(self, local_llm_url: str) -> GuardedEstimator:
        url = endpoint_url(self.url, self.backend, local_llm_url)
        controller = make_controller(
            self.backend,
            base_url=url,
            model=self.model,
            prompt=self.prompt,
            timeout_s=self.deadline_ms / 1000 + 1,
        )
        return GuardedEstimator(controller, self.deadline_ms / 1000)


def precision_recall_f1(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def persona_files(data: Path, names: Sequence[str] | None) -> list[Path]:
    files = sorted(data.glob("*_dialogues_256k.json"))
    if names:
        files = [f for f in files if persona_name_from_path(f) in set(names)]
    if not files:
        raise FileNotFoundError(f"no persona files matched in {data}")
    return files


class LocalLlm:
    """Starts the default stack's llama.cpp server when a llamacpp config has no URL, else nothing."""

    def __init__(self, configs: Sequence[ControllerConfig], console: Console) -> None:
        self._needed = any(c.backend == "llamacpp" and not c.url for c in configs)
        self._stack: Any = None
        self._console = console
        self.url = ""

    def __enter__(self) -> LocalLlm:
        if self._needed:
            from mars_stack import LocalStack, StackSettings

            self._console.print("starting the local llama.cpp server (SmolLM2-135M-Instruct)")
            settings = StackSettings(start_postgres=False, start_broker=False, services=())
            self._stack = LocalStack(settings).start()
            self.url = self._stack.env["MARS_LOCAL_LLM_URL"]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.stop()


@dataclass(frozen=True)
class Boundary:
    persona: str
    session_uuid: str
    first_user_turn: str
    #: User turns of the previous project session (the active thread the turn may continue).
    previous_turns: tuple[str, ...]
    #: Ground truth, used only to score: the task differs from the previous project session's.
    new_task: bool


def project_boundaries(path: Path) -> Iterator[Boundary]:
    """First user turn of every project session after the persona's first one."""
    raw = json.loads(path.read_text())
    name = persona_name_from_path(path)
    previous: tuple[str, tuple[str, ...]] | None = None
    for session in raw["dialogues"]:
        ident = str(session.get("session_identifier") or "")
        if not ident or ident.startswith("Enhanced:"):
            continue  # distractor sessions are not project sessions
        task = ident.split(":S")[0]
        users = tuple(
            str(t.get("content") or "")
            for t in session.get("dialogue_turns") or []
            if t.get("speaker") == "User"
        )
        if not users:
            continue
        if previous is not None:
            yield Boundary(
                name,
                str(session["session_uuid"]),
                users[0],
                previous[1][-CONTEXT_TURNS:],
                task != previous[0],
            )
        previous = (task, users)
