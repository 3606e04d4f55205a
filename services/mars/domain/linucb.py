"""Disjoint LinUCB router (paper Eq. 15/16; alpha 0.8, A_a = 1.0 * I and b_a = 0 at cold start, Table 8).

Models are immutable from the policy's point of view: `update` returns a new ArmModel, so a caller can
persist it with optimistic concurrency and drop it if the write loses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mars.v1 import events_pb2 as ev


@dataclass
class ArmModel:
    """Per-arm sufficient statistics: A = ridge*I + sum x x^T, b = sum r x, and a maintained A^-1."""

    A: np.ndarray
    A_inv: np.ndarray
    b: np.ndarray
    pulls: int = 0
    reward_sum: float = 0.0
    updates_since_refactor: int = 0

    @classmethod
    def cold(cls, dim: int, ridge: float = 1.0) -> ArmModel:
        if dim <= 0 or ridge <= 0:
            raise ValueError("dim and ridge must be positive")
        return cls(
            A=np.eye(dim, dtype=np.float64) * ridge,
            A_inv=np.eye(dim, dtype=np.float64) / ridge,
            b=np.zeros(dim, dtype=np.float64),
        )

    def shifted(self, x: np.ndarray, delta: float) -> ArmModel:
        """The same model with one already-counted reward moved by `delta` for context x: b += delta * x
        (A, its inverse and the pull count are unchanged, since no new observation arrived)."""
        return ArmModel(
            A=self.A,
            A_inv=self.A_inv,
            b=self.b + float(delta) * np.asarray(x, dtype=np.float64),
            pulls=self.pulls,
            reward_sum=self.reward_sum + float(delta),
            updates_since_refactor=self.updates_since_refactor,
        )

    @property
    def dim(self) -> int:
        return int(self.b.shape[0])

    def theta(self) -> np.ndarray:
        return self.A_inv @ self.b

    def sanity_error(self) -> str | None:
        """Why these matrices must not be used (non-finite, or A not positive definite), or None."""
        if not (np.isfinite(self.A).all() and np.isfinite(self.A_inv).all() and np.isfinite(self.b).all()):
            return "non-finite values"
        try:
            np.linalg.cholesky(self.A)
        except np.linalg.LinAlgError:
            return "A is not positive definite"
        return None

    def to_bytes(self) -> bytes:
        """Little-endian float64 A, A_inv (row-major) and b, plus the refactor counter as a trailing float.

        pulls and reward_sum are not included: the caller stores them as separate columns so they stay
        queryable without decoding the matrices.
        """
        parts = [self.A.ravel(), self.A_inv.ravel(), self.b, np.array([self.updates_since_refactor], float)]
        return np.concatenate(parts).astype("<f8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, dim: int, pulls: int = 0, reward_sum: float = 0.0) -> ArmModel:
        expected = (2 * dim * dim + dim + 1) * 8
        if len(data) != expected:
            raise ValueError(f"arm model blob has {len(data)} bytes, expected {expected} for dim {dim}")
        flat = np.frombuffer(data, dtype="<f8").astype(np.float64)
        n2 = dim * dim
        return cls(
            A=flat[:n2].reshape(dim, dim).copy(),
            A_inv=flat[n2 : 2 * n2].reshape(dim, dim).copy(),
            b=flat[2 * n2 : 2 * n2 + dim].copy(),
            pulls=pulls,
            reward_sum=reward_sum,
            updates_since_refactor=int(flat[-1]),
        )


class LinUCBPolicy:
    """Scores arms by theta^T x + alpha * sqrt(x^T A^-1 x) and updates the chosen arm only."""

    def __init__(
        self,
        arms: Sequence[str],
        dim: int,
        alpha: float = 0.8,
        ridge: float = 1.0,
        refactor_every: int = 50,
    ) -> None:
        if not arms:
            raise ValueError("LinUCB needs at least one arm")
        if len(set(arms)) != len(arms):
            raise ValueError("arm names must be unique")
        self.arms: tuple[str, ...] = tuple(arms)
        self.dim = dim
        self.alpha = alpha
        self.ridge = ridge
        self.refactor_every = max(1, refactor_every)

    def cold_models(self) -> dict[str, ArmModel]:
        return {arm: ArmModel.cold(self.dim, self.ridge) for arm in self.arms}

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.dim,):
            raise ValueError(f"feature vector has shape {x.shape}, expected ({self.dim},)")
        return x

    def score(self, x: np.ndarray, models: Mapping[str, ArmModel]) -> list[ev.ArmScore]:
        """Eq. 15 terms for every arm in policy order; arms without a model are scored cold."""
        x = self._check(x)
        out: list[ev.ArmScore] = []
        for arm in self.arms:
            model = models.get(arm) or ArmModel.cold(self.dim, self.ridge)
            mean = float(model.theta() @ x)
            # Clamp tiny negative round-off before the sqrt; A_inv is PSD in exact arithmetic.
            bonus = self.alpha * math.sqrt(max(float(x @ model.A_inv @ x), 0.0))
            out.append(ev.ArmScore(arm=arm, mean=mean, bonus=bonus, ucb=mean + bonus))
        return out

    def choose(self, x: np.ndarray, models: Mapping[str, ArmModel]) -> tuple[str, list[ev.ArmScore]]:
        """argmax of UCB; ties go to the arm listed first (deterministic, reproducible routing)."""
        scores = self.score(x, models)
        best = scores[0]
        for s in scores[1:]:
            if s.ucb > best.ucb:
                best = s
        return best.arm, scores

    def update(self, model: ArmModel, x: np.ndarray, reward: float) -> ArmModel:
        """Eq. 16 for the chosen arm: rank-1 Sherman-Morrison update, exact re-inversion periodically."""
        x = self._check(x)
        A = model.A + np.outer(x, x)
        b = model.b + float(reward) * x
        since = model.updates_since_refactor + 1
        if since >= self.refactor_every:
            # Periodic exact inverse bounds the drift accumulated by repeated rank-1 updates.
            A_inv = np.linalg.inv(A)
            since = 0
        else:
            Ax = model.A_inv @ x
            A_inv = model.A_inv - np.outer(Ax, Ax) / (1.0 + float(x @ Ax))
        A_inv = (A_inv + A_inv.T) / 2.0  # keep exact symmetry
        return ArmModel(
            A=A,
            A_inv=A_inv,
            b=b,
            pulls=model.pulls + 1,
            reward_sum=model.reward_sum + float(reward),
            updates_since_refactor=since,
        )
