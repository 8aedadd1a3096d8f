"""The load of the fault matrix (benchmarks/fault_matrix.py): fixed multi-turn conversations,
their known greedy answers from one plain engine, and one streamed completion request."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx

from fault_deployments import ENGINE_ARGS, free_port, stop, wait_http

QUESTIONS = ["Tell me about rivers.", "And the mountains?", "What about the sea?",
             "Name a city.", "Why is the sky blue?"]


@dataclass(frozen=True)
class Turn:
    """One request of the load: its prompt and the known greedy answer."""

    conversation: int
    index: int
    prompt: str
    answer: str = ""
    tokens: int = 0


def prompt_of(history: list[tuple[str, str]], question: str) -> str:
    """The completion prompt of a turn after ``history`` (question, answer pairs)."""
    text = "A conversation.\n"
    for q, a in history:
        text += f"User: {q}\nAssistant:{a}\n"
    return text + f"User: {question}\nAssistant:"


class Streaming:
    """How many requests are between their first token and their end (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


@dataclass
class Answer:
    """What a streamed completion returned: its text, completion tokens and whether it ended."""

    text: str = ""
    tokens: int | None = None
    done: bool = False
    error: str | None = None


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float,
                      extra: dict | None = None, streaming: Streaming | None = None) -> Answer:
    """One greedy streamed ``/v1/completions`` request; never raises (errors go in
    :attr:`Answer.error`). ``streaming`` counts this request from its first token to its
    end."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, **(extra or {})}
    out = Answer()
    counted = False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(timeout_s)) as resp:
            if resp.status_code != 200:
                resp.read()
                out.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return out
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {event['error']}"
                    return out
                for choice in event.get("choices") or []:
                    out.text += choice.get("text") or ""
                if streaming is not None and out.text and not counted:
                    counted = True
                    streaming.add(1)
                if event.get("usage"):
                    out.tokens = event["usage"].get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        if counted:
            streaming.add(-1)
    if out.error is None and not out.done:
        out.error = "stream ended without [DONE]"
    return out


def known_answers(model: str, args: argparse.Namespace, work: Path) -> list[list[Turn]]:
    """Every turn of every conversation, answered by one plain engine (greedy)."""
    port = free_port()
    log = open(work / "reference.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", model, "--port",
                             str(port), "--device", args.device, *ENGINE_ARGS],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, args.startup_timeout, "the reference engine")
        conversations = []
        for c in range(args.conversations):
            history: list[tuple[str, str]] = []
            turns = []
            for t in range(args.turns):
                question = QUESTIONS[(c + t) % len(QUESTIONS)] + f" (#{c})"
                prompt = prompt_of(history, question)
                ans = stream_completion(url, model, prompt, args.max_tokens, 120)
                if ans.error:
                    raise SystemExit(f"reference engine: {ans.error}")
                turns.append(Turn(c, t, prompt, ans.text, ans.tokens or 0))
                history.append((question, ans.text))
            conversations.append(turns)
        return conversations
    finally:
        stop(proc)
        log.close()


