"""Helpers for end-to-end P/D tests: ``pdserve serve`` subprocesses, the two proxy-style legs,
and ``/metrics`` scraping."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

import httpx

from servers import EngineServer, free_port, nixl_config, start_all

__all__ = ["Server", "decode_leg", "free_port", "generate", "nixl_config", "prefill_leg",
           "start_all"]


class Server(EngineServer):
    """One ``pdserve serve`` process (an API server plus its engine core), with an HTTP
    ``client`` on its URL.

    Args:
        model: model directory.
        log_path: file receiving the process's stdout and stderr.
        kv_config: ``--kv-transfer-config`` dict, or None for a plain instance.
        args: extra CLI arguments.
    """

    def __init__(self, model: str, log_path: Path, kv_config: dict | None = None,
                 args: list[str] | None = None):
        super().__init__(model, log_path, kv_config, args)
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def wait_metrics(self, predicate: Callable[[dict[str, float]], bool],
                     timeout_s: float = 20.0) -> dict[str, float]:
        """Poll ``/metrics`` until ``predicate`` holds; returns the last scrape."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics condition not met in {timeout_s} s: "
                                     f"{ {k: v for k, v in m.items() if 'nixl' in k or 'kv_cache' in k or 'prompt' in k} }")
            time.sleep(0.1)

    def wait_all_blocks_free(self, timeout_s: float = 20.0) -> dict[str, float]:
        return self.wait_metrics(
            lambda m: m.get("pdserve:kv_cache_free_blocks") == m.get("pdserve:kv_cache_total_blocks"),
            timeout_s,
        )

    def stop(self) -> None:
        super().stop()
        self.client.close()

    def kill(self) -> None:
        """SIGKILL the API server and its engine core (the whole instance dies at once)."""
        children = _children(self.proc.pid)
        self.proc.kill()
        self.proc.wait(10)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and _state(pid) not in ("Z", None)
                  for pid in children):
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {children} survived SIGKILL")
            time.sleep(0.05)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


# ---------------------------------------------------------------------------------- requests
def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def generate(server: Server, endpoint: str, body: dict) -> dict:
    """Run one request; returns ``{"status", "text", "kv_transfer_params", "error", "body"}``
    for both streaming and non-streaming bodies."""
    path = f"/v1/{endpoint}"
    if body.get("stream"):
        with server.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "text": None, "error": r.json(),
                        "kv_transfer_params": None, "body": None}
            events = sse_events(r)
        text, params, error = "", None, None
        for ev in events:
            if "error" in ev:
                error = ev
                continue
            for ch in ev.get("choices") or []:
                text += (ch.get("text") or (ch.get("delta") or {}).get("content") or "")
            if ev.get("kv_transfer_params") is not None:
                params = ev["kv_transfer_params"]
        return {"status": 200 if error is None else 500, "text": None if error else text,
                "error": error, "kv_transfer_params": params, "body": events}
    r = server.client.post(path, json=body)
    data = r.json()
    if r.status_code != 200:
        return {"status": r.status_code, "text": None, "error": data, "kv_transfer_params": None,
                "body": data}
    ch = data["choices"][0]
    text = ch["text"] if endpoint == "completions" else ch["message"]["content"]
    return {"status": 200, "text": text, "error": None,
            "kv_transfer_params": data.get("kv_transfer_params"), "body": data}


def prefill_leg(p: Server, endpoint: str, body: dict) -> dict:
    """The proxy's request to P: ``max_tokens=1``, not streamed, ``do_remote_decode``.
    Returns P's ``kv_transfer_params``."""
    leg = dict(body, max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    out = generate(p, endpoint, leg)
    assert out["status"] == 200, out
    params = out["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, out
    return params


def decode_leg(d: Server, endpoint: str, body: dict, params: dict) -> dict:
    """The proxy's request to D: the original body plus P's params."""
    return generate(d, endpoint, dict(body, kv_transfer_params=params))
