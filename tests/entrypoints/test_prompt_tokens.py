"""Chat prompt tokenization shortcuts: the per-message token cache and the prefiller's prompt
ids handed to the decoder in ``kv_transfer_params``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from pdserve.entrypoints.chat_tokenization import SegmentCachedEncoder
from pdserve.types import prompt_handoff


# ------------------------------------------------------------------ piece-cached encoding
class CountingTokenizer:
    """Wraps a tokenizer and records the texts its batch call encodes."""

    def __init__(self, tok):
        self.tok = tok
        self.is_fast = tok.is_fast
        self.added_tokens_decoder = tok.added_tokens_decoder
        self.batch_texts: list[str] = []

    def __call__(self, texts, add_special_tokens):
        self.batch_texts.extend(texts)
        return self.tok(texts, add_special_tokens=add_special_tokens)

    def encode(self, text, add_special_tokens):
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


def random_text(rng, tok, n):
    pieces = [tok.decode([rng.randrange(tok.vocab_size)]) for _ in range(n)]
    return "".join(pieces) + rng.choice(["", " ", "\n", "  \n", "<|im_end|>", " <|im_start|>x"])


def test_piece_cache_matches_whole_prompt_encoding_and_encodes_each_message_once(tiny_llama_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    counting = CountingTokenizer(tok)
    enc = SegmentCachedEncoder(counting, verify_first=0, verify_every=10**9)
    assert enc.enabled and "<|im_start|>" in enc.boundaries
    rng = random.Random(0)
    messages = [{"role": "system", "content": random_text(rng, tok, 50)}]
    for turn in range(6):
        messages.append({"role": "user", "content": random_text(rng, tok, 200)})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before = len(counting.batch_texts)
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), turn
        encoded_now = "".join(counting.batch_texts[before:])
        if turn:  # only the new messages (and the generation prompt) were tokenized
            assert messages[1]["content"] not in encoded_now
            assert messages[-1]["content"].split("<|im")[0] in encoded_now
        messages.append({"role": "assistant", "content": random_text(rng, tok, 30)})
    assert enc.encode(text) == tok.encode(text, add_special_tokens=False)  # all from cache


def test_piece_cache_bound_evicts_old_pieces(tiny_llama_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    enc = SegmentCachedEncoder(tok, max_tokens=50, verify_first=0)
    rng = random.Random(1)
    for _ in range(5):
        text = "<|im_start|>user\n" + random_text(rng, tok, 40) + "<|im_end|>\n"
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)
    assert enc._tokens <= 50


class SplitSensitiveTokenizer:
    """A "fast" tokenizer for which encoding pieces separately differs from the whole."""

    is_fast = True
    added_tokens_decoder = {0: SimpleNamespace(content="<s>", special=True, lstrip=False)}

    def encode(self, text, add_special_tokens):
        return [len(text)]

    def __call__(self, texts, add_special_tokens):
        return {"input_ids": [[len(t)] for t in texts]}


def test_verification_turns_the_cache_off_when_pieces_differ():
    enc = SegmentCachedEncoder(SplitSensitiveTokenizer(), verify_first=1)
    assert enc.encode("a<s>bc<s>d") == [10]  # the plain result, not [1, 5, 4]
    assert not enc.enabled
    assert enc.encode("x<s>y") == [5]


def test_self_check_on_sample_chats_decides_before_any_request(tiny_llama_path):
    from transformers import AutoTokenizer

    from pdserve.entrypoints.chat_tokenization import _sample_chats

    bad = SegmentCachedEncoder(SplitSensitiveTokenizer(), verify_first=0)
    assert not bad.self_check(["a<s>bc<s>d"])
    assert bad.encode("x<s>y") == [5]
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    chats = _sample_chats(tok)
    assert chats and all("<|im_start|>" in c for c in chats)
    good = SegmentCachedEncoder(tok, verify_first=0)
    assert good.self_check(chats) and good.enabled and not good._cache


# ------------------------------------------------------------------ P -> D prompt ids
def test_handoff_round_trip_and_rejections():
    ids = [0, 1, 49151, 2**31 + 5]
    digest = prompt_handoff.text_digest("hello", 49152)
    value = prompt_handoff.encode(ids, digest)
    assert prompt_handoff.decode(value, digest) == ids
    assert prompt_handoff.decode(value, digest, vocab_size=2**31 + 6) == ids
    assert prompt_handoff.decode(value, digest, vocab_size=49152) is None  # 2**31 + 5 is outside
    assert prompt_handoff.decode(value, prompt_handoff.text_digest("hello!", 49152)) is None
    assert prompt_handoff.decode(value, prompt_handoff.text_digest("hello", 100)) is None
    assert prompt_handoff.decode(None, digest) is None
    assert prompt_handoff.decode({"text_sha256": digest, "ids": "not base64!"}, digest) is None
    assert prompt_handoff.decode({"text_sha256": digest, "ids": "AAA="}, digest) is None  # 2 bytes
    with pytest.raises(OverflowError):
        prompt_handoff.encode([-1], digest)


MESSAGES = [{"role": "user", "content": "hello there"}]


def rendered_digest(engine, messages):
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, prompt_handoff.text_digest(text, engine.model_info.vocab_size)


async def test_prefiller_hands_on_its_prompt_ids(client, fake_engine):
    fake_engine.returned_kv_params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    r = await client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    (call,) = fake_engine.calls.values()
    _, digest = rendered_digest(fake_engine, MESSAGES)
    assert prompt_handoff.decode(params[prompt_handoff.KEY], digest) == call["prompt"]
    assert params["remote_block_ids"] == [1]


async def test_plain_requests_get_no_prompt_ids(client, fake_engine):
    fake_engine.returned_kv_params = {"do_remote_decode": True, "remote_block_ids": [1]}
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert prompt_handoff.KEY not in r.json()["kv_transfer_params"]


async def test_decoder_uses_handed_ids_only_for_the_same_rendered_text(client, fake_engine):
    text, digest = rendered_digest(fake_engine, MESSAGES)
    own = fake_engine.tokenizer.encode(text, add_special_tokens=False)
    handed = list(reversed(own))  # different from D's own tokenization, so use is visible
    params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "r",
              prompt_handoff.KEY: prompt_handoff.encode(handed, digest)}
    body = {"messages": MESSAGES, "max_tokens": 2, "kv_transfer_params": params}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    other = [{"role": "user", "content": "something else"}]
    r = await client.post("/v1/chat/completions", json=dict(body, messages=other))
    assert r.status_code == 200, r.text
    first, second = fake_engine.calls.values()
    assert first["prompt"] == handed
    assert prompt_handoff.KEY not in first["kv"] and first["kv"]["remote_block_ids"] == [1]
    other_text, _ = rendered_digest(fake_engine, other)
    assert second["prompt"] == fake_engine.tokenizer.encode(other_text, add_special_tokens=False)
