"""`pdserve bench multi-turn` against the recording fake server (tests/bench/conftest.py)."""

import json

import numpy as np
import pytest

from pdserve.bench.conversations import generate_conversations
from pdserve.bench.multi_turn import main


def write_spec(tmp_path, num_conversations=5, turns=(2, 8), user_tokens=(5, 15), output=(3, 9),
               name="spec.json"):
    spec = {
        "filetype": "generate_conversations",
        "num_conversations": num_conversations,
        "prompt_input": {
            "num_turns": {"distribution": "uniform", "min": turns[0], "max": turns[1]},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 6},
            "prefix_num_tokens": {"distribution": "constant", "value": 8},
            "num_tokens": {"distribution": "uniform", "min": user_tokens[0], "max": user_tokens[1]},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": output[0], "max": output[1]}},
    }
    path = tmp_path / name
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path, spec


def bench(capsys, server, spec_path, tokenizer_dir, *extra):
    argv = ["-i", str(spec_path), "-m", str(tokenizer_dir), "-u", server.url, "--no-progress", *extra]
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def group_by_conversation(requests):
    """Fake-server requests grouped by their first user message (unique per conversation)."""
    groups = {}
    for r in requests:
        groups.setdefault(r.body["messages"][0]["content"], []).append(r)
    return groups


def test_statistics_match_the_requests_seen(tmp_path, capsys, fake_server_factory,
                                            word_tokenizer, word_tokenizer_dir):
    server = fake_server_factory(chunk_tokens=3)
    spec_path, spec = write_spec(tmp_path)
    stats_path, out_path = tmp_path / "stats.json", tmp_path / "answers.json"
    rc, out, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "-p", 2, "-k", 4, "--seed", 3,
                       "--stats-json-output", stats_path, "-o", out_path)
    assert rc == 0
    convs = generate_conversations(spec, word_tokenizer, seed=3)
    by_first_user = {c.turns[0].user: c for c in convs}
    groups = group_by_conversation(server.requests)
    assert set(groups) == set(by_first_user)

    stats = json.loads(stats_path.read_text())
    records = {(r["conversation_id"], r["turn"]): r for r in stats["requests"]}
    assert len(stats["requests"]) == len(records) == len(server.requests)
    for first, seen in groups.items():
        conv = by_first_user[first]
        assert len(seen) == len(conv.turns)  # every turn sent, once
        for j, req in enumerate(seen):
            msgs = req.body["messages"]
            assert [m["role"] for m in msgs] == ["user", "assistant"] * j + ["user"]
            assert [m["content"] for m in msgs[0::2]] == [t.user for t in conv.turns[: j + 1]]
            # the history carries the answers this server actually gave, in order
            assert [m["content"] for m in msgs[1::2]] == [prev.answer for prev in seen[:j]]
            assert req.body["max_tokens"] == req.body["min_tokens"] == conv.turns[j].output_tokens
            assert req.body["stream"] is True
            assert req.body["stream_options"] == {"include_usage": True}
            assert req.body["model"] == "fake-model"  # discovered through GET /v1/models
            assert "conversation_id" not in req.body and "x-session-id" not in req.headers
            rec = records[(conv.id, j + 1)]
            assert rec["ok"] and rec["error"] is None
            assert rec["client"] == int(conv.id.split("-")[1]) % 2
            assert rec["input_num_tokens"] == req.prompt_tokens
            assert rec["output_num_tokens"] == req.completion_tokens == conv.turns[j].output_tokens
            assert rec["num_chunks"] == req.num_chunks == -(-req.completion_tokens // 3)
            assert rec["ttft_ms"] <= rec["latency_ms"]
            expected_tpot = (rec["latency_ms"] - rec["ttft_ms"]) / (rec["output_num_tokens"] - 1)
            assert rec["tpot_ms"] == pytest.approx(expected_tpot)

    summary = stats["summary"]
    assert summary["num_requests"] == len(server.requests) and summary["num_failed"] == 0
    assert summary["sections"]["turn 1"]["ttft_ms"]["count"] == len(convs)
    assert summary["sections"]["turns 2+"]["ttft_ms"]["count"] == len(server.requests) - len(convs)
    assert summary["total_output_tokens"] == sum(r.completion_tokens for r in server.requests)
    out_tokens_turn1 = [r.completion_tokens for r in server.requests if len(r.body["messages"]) == 1]
    assert summary["sections"]["turn 1"]["output_num_tokens"]["max"] == max(out_tokens_turn1)
    assert summary["sections"]["turn 1"]["output_num_tokens"]["mean"] == pytest.approx(
        np.mean(out_tokens_turn1))
    for entry in summary["per_turn"]:
        assert entry["count"] == sum(len(c.turns) >= entry["turn"] for c in convs)
    assert "turn 1" in out and "turns 2+" in out and "failed requests: 0" in out
    assert "requests_per_sec" in out and "output_tokens_per_sec" in out

    answers = {item["id"]: item["messages"] for item in json.loads(out_path.read_text())}
    for first, seen in groups.items():
        conv = by_first_user[first]
        last = seen[-1]
        assert answers[conv.id] == [*last.body["messages"], {"role": "assistant", "content": last.answer}]


def test_conversation_id_only_with_flag(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory()
    spec_path, _ = write_spec(tmp_path, num_conversations=4)
    rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "-p", 2, "-k", 4,
                     "--send-conversation-id")
    assert rc == 0
    ids_per_conversation = {}
    for req in server.requests:
        cid = req.body["conversation_id"]
        assert req.headers["x-session-id"] == cid
        ids_per_conversation.setdefault(req.body["messages"][0]["content"], set()).add(cid)
    assert all(len(ids) == 1 for ids in ids_per_conversation.values())  # stable across turns
    all_ids = set.union(*ids_per_conversation.values())
    assert len(all_ids) == len(ids_per_conversation) == 4  # one id per conversation

    server.reset()  # the same run without the flag sends neither field nor header
    rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "-p", 2, "-k", 4)
    assert rc == 0 and server.requests
    assert not any("conversation_id" in r.body or "x-session-id" in r.headers for r in server.requests)


def test_upstream_errors_are_failed_requests(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory(fail_requests={1, 4}, stream_error_requests={2}, chunk_tokens=2)
    spec_path, _ = write_spec(tmp_path, num_conversations=4, turns=(6, 6), output=(5, 5))
    stats_path, out_path = tmp_path / "stats.json", tmp_path / "answers.json"
    rc, out, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "-k", 2,
                       "--stats-json-output", stats_path, "-o", out_path)
    assert rc == 1
    stats = json.loads(stats_path.read_text())
    summary = stats["summary"]
    assert summary["num_requests"] == len(server.requests)
    assert summary["num_failed"] == 3
    assert summary["num_successful"] == len(server.requests) - 3
    assert {e["error"]: e["count"] for e in summary["errors"]} == {
        "HTTP 500: injected failure": 2,
        "error in stream: injected stream error": 1,
    }
    assert "failed requests: 3" in out and "HTTP 500: injected failure" in out
    failed = [r for r in stats["requests"] if not r["ok"]]
    assert all(r["ttft_ms"] is None and r["output_num_tokens"] is None for r in failed)
    # a failed turn ends its conversation: nothing more is sent for it
    groups = group_by_conversation(server.requests)
    for seen in groups.values():
        bad = [i for i, r in enumerate(seen) if r.index in {1, 2, 4}]
        assert bad in ([], [len(seen) - 1])
    written = {item["id"]: item for item in json.loads(out_path.read_text())}
    assert sum("error" in item for item in written.values()) == 3


def test_tokens_counted_per_token_without_usage(tmp_path, capsys, fake_server_factory,
                                                word_tokenizer_dir):
    server = fake_server_factory(send_usage=False, chunk_tokens=4, first_token_delay_s=0.05)
    spec_path, _ = write_spec(tmp_path, num_conversations=2, turns=(4, 4), output=(9, 9))
    stats_path = tmp_path / "stats.json"
    rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "--stats-json-output", stats_path)
    assert rc == 0
    records = json.loads(stats_path.read_text())["requests"]
    assert len(records) == len(server.requests) == 4
    for rec, req in zip(sorted(records, key=lambda r: r["start_s"]), server.requests):
        assert not rec["usage_from_server"]
        assert rec["output_num_tokens"] == 9 and rec["num_chunks"] == 3  # 4 + 4 + 1 tokens
        assert rec["input_num_tokens"] == req.prompt_tokens  # counted with the chat template
        assert rec["ttft_ms"] >= 50
        assert rec["tpot_ms"] == pytest.approx((rec["latency_ms"] - rec["ttft_ms"]) / 8)


def test_same_seed_same_conversations(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory()
    spec_path, _ = write_spec(tmp_path, num_conversations=4)

    def user_turns(seed):
        server.reset()
        rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "-p", 2, "-k", 4,
                         "--seed", seed)
        assert rc == 0
        return sorted((r.body["messages"][0]["content"], len(r.body["messages"]),
                       r.body["messages"][-1]["content"], r.body["max_tokens"])
                      for r in server.requests)

    assert user_turns(5) == user_turns(5)
    assert user_turns(5) != user_turns(6)


def test_plot_and_compare(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory()
    spec_path, _ = write_spec(tmp_path, num_conversations=3)
    base, new, png = tmp_path / "baseline.json", tmp_path / "bidir.json", tmp_path / "ttft.png"
    rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "--stats-json-output", base)
    assert rc == 0
    rc, out, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "--stats-json-output", new,
                       "--compare", base, "--plot", png)
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "TTFT by turn" in out and "baseline" in out and "bidir" in out

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    rc = main(["-u", server.url, "-m", str(word_tokenizer_dir), "--compare", str(bad)])
    assert rc == 2 and "not a stats file" in capsys.readouterr().err


def test_warmup_step_measures_turns_after_the_first(tmp_path, capsys, fake_server_factory,
                                                    word_tokenizer_dir):
    server = fake_server_factory()
    spec_path, _ = write_spec(tmp_path, num_conversations=3, turns=(6, 6))
    stats_path = tmp_path / "stats.json"
    rc, out, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "--warmup-step",
                       "--stats-json-output", stats_path)
    assert rc == 0
    stats = json.loads(stats_path.read_text())
    assert [r["turn"] for r in stats["warmup_requests"]] == [1, 1, 1]
    assert sorted(r["turn"] for r in stats["requests"]) == [2, 2, 2, 3, 3, 3]
    assert len(server.requests) == 9
    assert [len(r.body["messages"]) for r in server.requests[:3]] == [1, 1, 1]
    assert stats["summary"]["sections"]["turn 1"]["ttft_ms"]["count"] == 0
    assert "warmup (not included below): 3 requests" in out


@pytest.mark.parametrize(
    "extra, check",
    [
        (["-n", 4], lambda reqs: len(reqs) == 4),
        (["--max-turns", 1], lambda reqs: len(reqs) == 5 and all(len(r.body["messages"]) == 1 for r in reqs)),
        (["--limit-max-tokens", 4, "--limit-min-tokens", 2],
         lambda reqs: all(r.body["max_tokens"] == r.body["min_tokens"] == 4 for r in reqs)),
        (["--no-stream"], lambda reqs: all(r.body["stream"] is False and "stream_options" not in r.body
                                           for r in reqs)),
        (["--header", "X-Test=yes", "--api-key", "sekret", "--served-model-name", "other"],
         lambda reqs: all(r.headers["x-test"] == "yes" and r.headers["authorization"] == "Bearer sekret"
                          and r.body["model"] == "other" for r in reqs)),
    ],
)
def test_request_options(tmp_path, capsys, fake_server_factory, word_tokenizer_dir, extra, check):
    server = fake_server_factory()
    spec_path, _ = write_spec(tmp_path, num_conversations=5, turns=(4, 6), output=(7, 9))
    stats_path = tmp_path / "stats.json"
    rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "--stats-json-output", stats_path,
                     *extra)
    assert rc == 0
    assert check(server.requests)
    stats = json.loads(stats_path.read_text())
    assert stats["summary"]["num_requests"] == len(server.requests)
    assert "sekret" not in stats_path.read_text()  # secrets never written to the stats file
    if "--no-stream" in extra:
        assert all(r["ttft_ms"] is None and r["latency_ms"] > 0 for r in stats["requests"])
        assert [r["output_num_tokens"] for r in stats["requests"]] == [
            r.completion_tokens for r in server.requests]


def test_poisson_arrivals_per_client(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory()
    spec_path, _ = write_spec(tmp_path, num_conversations=2, turns=(6, 6))
    stats_path = tmp_path / "stats.json"
    rc, _, _ = bench(capsys, server, spec_path, word_tokenizer_dir, "--request-rate", 20,
                     "--seed", 9, "--stats-json-output", stats_path)
    assert rc == 0
    rng = np.random.default_rng(np.random.SeedSequence(9).spawn(1)[0])
    waits = rng.exponential(1 / 20, size=6)
    starts = sorted(r["start_s"] for r in json.loads(stats_path.read_text())["requests"])
    assert len(starts) == 6
    # each request waits its own exponential gap after the previous one finished
    assert all(s >= w for s, w in zip(starts, np.cumsum(waits)))


def test_bad_arguments_and_input(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory()
    spec_path, spec = write_spec(tmp_path)
    spec["prompt_input"]["num_tokens"] = {"distribution": "normal", "mean": 3}
    spec_path.write_text(json.dumps(spec))
    rc, _, err = bench(capsys, server, spec_path, word_tokenizer_dir)
    assert rc == 2 and "prompt_input.num_tokens" in err and "unknown distribution" in err
    rc, _, err = bench(capsys, server, spec_path, tmp_path / "no-such-model")
    assert rc == 2 and "no-such-model" in err
    for argv in (["--header", "novalue"], ["-p", "3", "-k", "2"], ["--limit-min-tokens", "5",
                 "--limit-max-tokens", "2"], ["--request-rate", "-1"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert not server.requests


@pytest.mark.parametrize("argv", [["--request-rate", "nan"], ["--request-rate", "inf"],
                                  ["--request-timeout-sec", "nan"]])
def test_non_finite_numbers_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("option", ["-o", "--stats-json-output", "--plot"])
def test_an_output_path_that_cannot_be_written_exits_2_before_the_run(option, tmp_path, capsys):
    """The parent directory of each output file is checked up front (the run took minutes
    before the write failed with a traceback)."""
    with pytest.raises(SystemExit) as info:
        main([option, str(tmp_path / "missing" / "x.json"), "-u", "http://127.0.0.1:9"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and str(tmp_path / "missing") in err
    with pytest.raises(SystemExit) as info:
        main([option, str(tmp_path), "-u", "http://127.0.0.1:9"])
    assert info.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_conversation_list_input(tmp_path, capsys, fake_server_factory, word_tokenizer_dir):
    server = fake_server_factory()
    data = [{"id": "chat-a", "messages": [
        {"role": "system", "content": "Be brief ."},
        {"role": "user", "content": "We hold these truths"},
        {"role": "assistant", "content": "that all men are created equal"},
        {"role": "user", "content": "Four score and seven years ago"},
        {"role": "assistant", "content": "our fathers"},
    ]}]
    path = tmp_path / "convs.json"
    path.write_text(json.dumps(data))
    rc, _, _ = bench(capsys, server, path, word_tokenizer_dir)
    assert rc == 0
    first, second = server.requests
    assert first.body["messages"] == data[0]["messages"][:2]
    assert first.body["max_tokens"] == 6 and second.body["max_tokens"] == 2
    # the recorded answer is replaced by the server's own answer
    assert second.body["messages"][2] == {"role": "assistant", "content": first.answer}
    assert second.body["messages"][3] == data[0]["messages"][3]


def test_unreachable_server_is_reported_not_crashed(tmp_path, capsys, word_tokenizer_dir):
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec_path, _ = write_spec(tmp_path, num_conversations=3)
    rc = main(["-i", str(spec_path), "-m", str(word_tokenizer_dir), "-u", f"http://127.0.0.1:{port}",
               "--no-progress", "--served-model-name", "m"])
    out = capsys.readouterr().out
    assert rc == 1
    # the first turn of each conversation fails; the conversation ends there
    assert "Multi-turn benchmark: 3 requests (0 successful, 3 failed)" in out
    assert "3 x ConnectError" in out
