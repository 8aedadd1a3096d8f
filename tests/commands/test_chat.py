"""Tests of ``pdserve chat`` (pdserve/commands/chat.py) against a fake OpenAI-compatible streaming server."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.commands import chat


class FakeOpenAIServer:
    """A streaming ``/v1/chat/completions`` server on a free port.

    The answer to a turn is ``"reply <n> to <user text>"`` in word-sized deltas; the final usage
    chunk reports ``cached_tokens = 10 * (earlier turns of the same conversation_id)``. A user
    text ``boom`` gets an OpenAI-style 400 error. With ``gate`` set, the server sends the first
    delta and then waits for ``gate`` before sending the rest (to prove that the client streams).
    """

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.gate: threading.Event | None = None
        self.gate_waited: bool | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                server.headers.append(dict(self.headers))
                user = body["messages"][-1]["content"]
                if user == "boom":
                    self._json(400, {"error": {"message": "boom is not allowed",
                                               "type": "invalid_request_error"}})
                    return
                turn = sum(1 for b in server.bodies if b.get("conversation_id")
                           == body.get("conversation_id"))
                words = f"reply {turn} to {user}".split(" ")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()

                def event(obj):
                    self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                    self.wfile.flush()

                event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                for i, word in enumerate(words):
                    text = word if i == 0 else " " + word
                    event({"choices": [{"index": 0, "delta": {"content": text},
                                        "finish_reason": None}]})
                    if i == 0 and server.gate is not None:
                        server.gate_waited = server.gate.wait(10)
                event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                prompt = 20 * turn
                event({"choices": [], "usage": {
                    "prompt_tokens": prompt, "completion_tokens": len(words),
                    "total_tokens": prompt + len(words),
                    "prompt_tokens_details": {"cached_tokens": 10 * (turn - 1)}}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def server():
    with FakeOpenAIServer() as srv:
        yield srv


def _run(url: str, stdin_text: str, *extra: str) -> tuple[int, str]:
    args = chat.build_parser().parse_args(["--url", url, *extra])
    out = io.StringIO()
    rc = chat.run(args, io.StringIO(stdin_text), out)
    return rc, out.getvalue()


def test_conversation_keeps_id_history_and_reports_kv_reuse(server):
    rc, out = _run(server.url + "/v1", "Hello\nAgain\n/reset\nNew topic\n/exit\nignored\n",
                   "--system", "be brief")
    assert rc == 0
    assert len(server.bodies) == 3
    first, second, third = server.bodies
    assert first["model"] == "fake-model"  # discovered from /v1/models
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["conversation_id"] == second["conversation_id"] != third["conversation_id"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == "reply 1 to Hello"
    assert [m["content"] for m in third["messages"]] == ["be brief", "New topic"]
    assert "assistant> reply 1 to Hello" in out and "assistant> reply 2 to Again" in out
    assert out.count("TTFT ") == 3
    assert "KV reused: no (0 of 20 prompt tokens)" in out
    assert "KV reused: 10 of 40 prompt tokens" in out
    assert f"(new conversation {third['conversation_id']})" in out
    assert "ignored" not in "".join(m["content"] for b in server.bodies for m in b["messages"])


def test_error_turn_is_reported_and_not_kept(server):
    rc, out = _run(server.url, "boom\nHi\n", "--model", "m", "--api-key", "sk-test")
    assert rc == 0  # Ctrl-D (end of input) quits normally
    assert "error: HTTP 400: boom is not allowed" in out
    assert [m["content"] for m in server.bodies[1]["messages"]] == ["Hi"]
    assert server.bodies[1]["model"] == "m"
    assert server.headers[1]["Authorization"] == "Bearer sk-test"


def test_tokens_are_shown_while_the_answer_streams(server):
    server.gate = threading.Event()
    seen: list[str] = []

    def on_token(token: str) -> None:
        seen.append(token)
        server.gate.set()  # the server holds the rest of the answer until the first token is seen

    with httpx.Client(base_url=server.url, timeout=30) as client:
        stats = chat.ChatSession(client, "fake-model").send("stream please", on_token)
    assert server.gate_waited is True
    assert "".join(seen) == "reply 1 to stream please"
    assert stats.ttft_s is not None and stats.ttft_s <= stats.total_s
    assert (stats.completion_tokens, stats.cached_tokens, stats.finish_reason) == (5, 0, "stop")


def test_format_stats_without_usage():
    line = chat.format_stats(chat.TurnStats(ttft_s=0.25, total_s=1.0, finish_reason="length"))
    assert line == "[TTFT 250 ms | KV reuse: not reported | cut at max_tokens]"


def test_unreachable_endpoint_is_a_clear_error(capsys):
    with FakeOpenAIServer() as srv:
        url = srv.url
    rc, _ = _run(url, "hi\n", "--timeout", "2")
    assert rc == 1
    assert f"cannot reach {url}" in capsys.readouterr().err


@pytest.mark.slow
def test_piped_stdin_through_the_cli(server):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "chat", "--url", server.url],
        input="What is the capital of France?\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "assistant> reply 1 to What is the capital of France?" in proc.stdout
    assert "TTFT" in proc.stdout
    assert len(server.bodies) == 1
