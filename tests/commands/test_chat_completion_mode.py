"""``pdserve chat`` against a model without a chat template: it continues the conversation's
text through /v1/completions instead of failing on its first turn (the real server app, in
process, with the fake engine)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.support.fake_engine_for_server import FakeEngine

from pdserve.commands import chat
from pdserve.entrypoints.server import build_app


@pytest.fixture
def base_model_client():
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer.chat_template = None
    with TestClient(build_app(engine)) as client:
        yield client


def test_session_switches_to_completions_and_keeps_the_history(base_model_client):
    session = chat.ChatSession(base_model_client, "fake-model", max_tokens=4, temperature=0)
    notes: list[str] = []
    tokens: list[str] = []
    stats = session.send("hello", tokens.append, notes.append)
    assert notes == [chat.COMPLETION_NOTE]
    assert session.mode is chat.ChatMode.COMPLETION
    assert tokens and stats.completion_tokens == 4
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    stats = session.send("more", tokens.append, notes.append)
    assert notes == [chat.COMPLETION_NOTE]  # said once
    assert session.prompt_text().startswith("hello\n")
    assert stats.completion_tokens == 4


def test_completions_flag_starts_in_completion_mode(base_model_client):
    session = chat.ChatSession(base_model_client, "fake-model", max_tokens=2,
                               mode=chat.ChatMode.COMPLETION)
    assert "prompt" in session.request_body() and "messages" not in session.request_body()
    notes: list[str] = []
    session.send("hi", lambda t: None, notes.append)
    assert notes == []


def test_other_400s_still_fail_the_turn(base_model_client):
    session = chat.ChatSession(base_model_client, "no-such-model", max_tokens=2)
    with pytest.raises(chat.ChatError):
        session.send("hi", lambda t: None)
    assert session.mode is chat.ChatMode.CHAT and session.messages == []


def test_parser_has_completions_flag():
    assert chat.build_parser().parse_args(["--completions"]).completions is True


def test_a_template_that_refuses_the_conversation_does_not_switch(monkeypatch):
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with TestClient(build_app(engine)) as client:
        session = chat.ChatSession(client, "fake-model", max_tokens=2)
        with pytest.raises(chat.ChatError, match="chat template"):
            session.send("hi", lambda t: None)
    assert session.mode is chat.ChatMode.CHAT
