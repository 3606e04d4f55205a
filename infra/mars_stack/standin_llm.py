"""A stand-in LLM for load and fault runs: an OpenAI-compatible HTTP server that answers every chat
completion after a fixed latency with a short deterministic reply (plain or streamed).

It is the one test double of the load and chaos harnesses: they measure MARS's own path (broker hops,
Postgres, retrieval, routing, supervision), which a real model on this 2-core machine (llama.cpp does
about one turn a second here) would hide. The replies echo the question, so memory and views still have
real text to work on.

    python -m mars_stack.standin_llm --port 8081 --latency-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid

MODEL = "standin"


def reply_text(messages: list[dict[str, object]]) -> str:
    last = next((str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"), "")
    words = last.split()
    return "Noted: " + " ".join(words[:24]) if words else "Noted."


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


def completion(body: dict[str, object]) -> dict[str, object]:
    messages = body.get("messages") or []
    assert isinstance(messages, list)
    text = reply_text(messages)
    prompt = sum(_tokens(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or MODEL),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": _tokens(text),
            "total_tokens": prompt + _tokens(text),
        },
    }


class StandinServer:
    def __init__(self, latency_ms: float) -> None:
        self.latency_s = latency_ms / 1000.0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one connection carries many requests
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                await self._route(method, path.split("?", 1)[0], body, writer)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            self._send(writer, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif method == "GET" and path == "/health":
            self._send(writer, 200, {"status": "ok"})
        elif method == "POST" and path == "/v1/chat/completions":
            try:
                body = json.loads(raw or b"{}")
                out = completion(body)
            except (ValueError, AssertionError) as exc:
                self._send(writer, 400, {"error": {"message": f"bad request: {exc}"}})
                return
            await asyncio.sleep(self.latency_s)
            if body.get("stream"):
                await self._stream(writer, out)
            else:
                self._send(writer, 200, out)
        else:
            self._send(writer, 404, {"error": {"message": f"no route {method} {path}"}})
        await writer.drain()

    @staticmethod
    def _send(writer: asyncio.StreamWriter, status: int, payload: dict[str, object]) -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'ERR'}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    @staticmethod
    async def _stream(writer: asyncio.StreamWriter, out: dict[str, object]) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        choices = out["choices"]
        assert isinstance(choices, list)
        text = choices[0]["message"]["content"]
        base = {
            "id": out["id"],
            "object": "chat.completion.chunk",
            "created": out["created"],
            "model": out["model"],
        }
        events = [
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": piece}, "finish_reason": None}
                ],
            }
            for piece in [w + " " for w in text.split(" ")]
        ]
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        events.append({**base, "choices": [], "usage": out["usage"]})
        for event in events:
            chunk = f"data: {json.dumps(event)}\n\n".encode()
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        done = b"data: [DONE]\n\n"
        writer.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")


async def serve(host: str, port: int, latency_ms: float) -> None:
    server = await asyncio.start_server(StandinServer(latency_ms).handle, host, port, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--latency-ms", type=float, default=50.0, help="fixed time before each answer (default 50)"
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.latency_ms))


if __name__ == "__main__":
    main()
