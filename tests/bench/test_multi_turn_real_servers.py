"""`pdserve bench multi-turn` against real processes: one `pdserve serve` on the tiny Llama, and
a bidirectional P/D pair behind `pdserve proxy --multi-turn` (what `pdserve up --multi-turn`
starts) with `--send-conversation-id`. Both are the session's shared instances
(``tests/support/servers.py``), so counters are compared before and after."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from pdserve.bench.multi_turn import main
from pdserve.bench.runner import count_prompt_tokens
from pdserve.model_files.client_tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _spec(tmp_path: Path, num_conversations: int, user_tokens: int) -> Path:
    spec = {
        "filetype": "generate_conversations",
        "num_conversations": num_conversations,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 6},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 40},
            "num_tokens": {"distribution": "uniform", "min": user_tokens, "max": user_tokens + 10},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 4, "max": 8}},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture
def engine_server(server_pool):
    """URL of the session's shared plain instance."""
    return server_pool.get("single")["single"].url


def test_against_a_real_engine(tmp_path, capsys, engine_server, tiny_llama_path):
    stats_path, out_path = tmp_path / "stats.json", tmp_path / "answers.json"
    rc = main(["-i", str(_spec(tmp_path, 3, 20)), "-m", tiny_llama_path, "-u", engine_server,
               "-p", "2", "-k", "3", "--no-progress", "--stats-json-output", str(stats_path),
               "-o", str(out_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    stats = json.loads(stats_path.read_text())
    records = stats["requests"]
    assert len(records) == 9 and all(r["ok"] for r in records)  # 3 conversations x 3 turns
    assert stats["summary"]["sections"]["turn 1"]["ttft_ms"]["count"] == 3
    assert stats["summary"]["sections"]["turns 2+"]["ttft_ms"]["count"] == 6
    for r in records:
        assert r["usage_from_server"]
        # max_tokens == min_tokens: the engine produces exactly the requested length
        assert r["output_num_tokens"] == r["max_tokens"]
        assert 0 < r["ttft_ms"] <= r["latency_ms"]
    by_conv: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: r["turn"]):
        by_conv.setdefault(r["conversation_id"], []).append(r)
    for turns in by_conv.values():
        assert [r["turn"] for r in turns] == [1, 2, 3]
        tokens = [r["input_num_tokens"] for r in turns]
        assert tokens[0] < tokens[1] < tokens[2]  # the history grows turn by turn

    # the server's prompt token counts equal the bench's own count of the messages it sent
    tokenizer = load_tokenizer(tiny_llama_path)
    for conv in json.loads(out_path.read_text()):
        messages = conv["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        for turn in range(3):
            sent = messages[: 2 * turn + 1]
            record = by_conv[conv["id"]][turn]
            assert count_prompt_tokens(tokenizer, sent) == record["input_num_tokens"]


def _metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)]
    assert values, f"metric {name} not exposed"
    return sum(values)


@pytest.fixture
def pd_deployment(server_pool):
    """The session's multi-turn proxy URL and its bidirectional decoder."""
    decoder = server_pool.get("d_bidir")["d_bidir"]
    proxy = server_pool.proxy("multi-turn", ["p_bidir"], ["d_bidir"], ["--multi-turn"])
    return proxy.url, decoder.url


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def test_through_the_multi_turn_proxy_with_conversation_ids(tmp_path, capsys, pd_deployment,
                                                            tiny_llama_path):
    url, decoder_url = pd_deployment
    conversations0 = _metric(_metrics(url), "pdserve:proxy_conversations")
    transferred0 = _metric(_metrics(decoder_url), "pdserve:prompt_tokens_transferred_total")
    stats_path = tmp_path / "stats.json"
    rc = main(["-i", str(_spec(tmp_path, 2, 30)), "-m", tiny_llama_path, "-u", url,
               "-p", "2", "--no-progress", "--send-conversation-id",
               "--stats-json-output", str(stats_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    records = json.loads(stats_path.read_text())["requests"]
    assert len(records) == 6 and all(r["ok"] for r in records)
    assert all(r["output_num_tokens"] == r["max_tokens"] for r in records)
    # The proxy linked the turns: it remembers exactly one entry per conversation id sent.
    assert _metric(_metrics(url), "pdserve:proxy_conversations") == conversations0 + 2
    # The answers were decoded on D from KV computed on P (P -> D over NIXL).
    assert _metric(_metrics(decoder_url), "pdserve:prompt_tokens_transferred_total") > transferred0
