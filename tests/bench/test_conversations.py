import json

import pytest

from pdserve.bench.conversations import (
    DEFAULT_TEXT_FILE,
    EXAMPLE_SPEC_FILE,
    generate_conversations,
    load_conversations,
    parse_conversation_list,
)
from pdserve.bench.distributions import SpecError


def spec(**overrides):
    base = {
        "filetype": "generate_conversations",
        "num_conversations": 6,
        "prompt_input": {
            "num_turns": {"distribution": "uniform", "min": 2, "max": 9},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 6},
            "prefix_num_tokens": {"distribution": "constant", "value": 8},
            "num_tokens": {"distribution": "constant", "value": 12},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 3, "max": 9}},
    }
    base.update(overrides)
    return base


def ntok(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_generation_is_deterministic_for_a_seed(word_tokenizer):
    first = generate_conversations(spec(), word_tokenizer, seed=11)
    again = generate_conversations(spec(), word_tokenizer, seed=11)
    other = generate_conversations(spec(), word_tokenizer, seed=12)
    assert first == again
    assert [t.user for c in first for t in c.turns] != [t.user for c in other for t in c.turns]


def test_generation_follows_the_spec(word_tokenizer):
    convs = generate_conversations(spec(), word_tokenizer, seed=3)
    assert [c.id for c in convs] == [f"conv-{i:04d}" for i in range(6)]
    for conv in convs:
        # num_turns counts user and assistant messages (2..9), rounded up to whole user turns
        assert 1 <= len(conv.turns) <= 5
        # the word tokenizer re-encodes decoded text exactly: 6 common + 8 own prefix + 12 tokens
        assert ntok(word_tokenizer, conv.turns[0].user) == 6 + 8 + 12
        for turn in conv.turns[1:]:
            assert ntok(word_tokenizer, turn.user) == 12
        assert all(3 <= t.output_tokens <= 9 for t in conv.turns)
    firsts = [c.turns[0].user for c in convs]
    common = firsts[0].split("\n\n")[0]
    assert ntok(word_tokenizer, common) == 6
    assert all(f.startswith(common + "\n\n") for f in firsts)
    assert len(set(firsts)) == len(firsts)


def test_odd_num_turns_rounds_up_to_a_full_user_turn(word_tokenizer):
    s = spec()
    s["prompt_input"]["num_turns"] = {"distribution": "constant", "value": 5}
    convs = generate_conversations(s, word_tokenizer, seed=0)
    assert {len(c.turns) for c in convs} == {3}


def test_text_files_relative_to_spec_file(tmp_path, word_tokenizer):
    (tmp_path / "mine.txt").write_text("Liberty " * 50, encoding="utf-8")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec(text_files=["mine.txt"])), encoding="utf-8")
    convs = load_conversations(path, word_tokenizer, seed=0)
    assert {w for c in convs for t in c.turns for w in t.user.split()} == {"Liberty"}
    path.write_text(json.dumps(spec(text_files=["missing.txt"])), encoding="utf-8")
    with pytest.raises(SpecError, match="missing.txt"):
        load_conversations(path, word_tokenizer, seed=0)


def test_shipped_example_spec_and_text(word_tokenizer):
    assert DEFAULT_TEXT_FILE.stat().st_size > 4000
    convs = load_conversations(EXAMPLE_SPEC_FILE, word_tokenizer, seed=0)
    assert len(convs) == json.loads(EXAMPLE_SPEC_FILE.read_text())["num_conversations"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("prompt_output"), "missing key"),
        (lambda s: s.update(num_conversations=0), "num_conversations"),
        (lambda s: s["prompt_input"].update(num_tokens={"distribution": "zipf", "alpha": 0.5}),
         "prompt_input.num_tokens"),
        (lambda s: s["prompt_input"].update(turns=3), "unknown key"),
    ],
)
def test_bad_spec_errors(word_tokenizer, mutate, message):
    s = spec()
    mutate(s)
    with pytest.raises(SpecError, match=message):
        generate_conversations(s, word_tokenizer, seed=0)


def test_conversation_list_parsing(word_tokenizer):
    convs = parse_conversation_list(
        [
            {"id": "a", "messages": [
                {"role": "system", "content": "Be brief ."},
                {"role": "user", "content": "We hold these truths"},
                {"role": "assistant", "content": "that all men are created equal"},
                {"role": "user", "content": "Four score"},
            ]},
        ],
        word_tokenizer,
    )
    (conv,) = convs
    assert conv.system == [{"role": "system", "content": "Be brief ."}]
    assert [(t.user, t.output_tokens) for t in conv.turns] == [
        ("We hold these truths", 6), ("Four score", None)]


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "assistant", "content": "x"}], "expected role 'user'"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "expected role 'assistant'"),
        ([{"role": "user"}], "content"),
        ([], "no user message"),
    ],
)
def test_conversation_list_errors(word_tokenizer, messages, message):
    with pytest.raises(SpecError, match=message):
        parse_conversation_list([{"id": "c", "messages": messages}], word_tokenizer)
