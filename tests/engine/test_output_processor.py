"""The front end's handling of core deltas (:func:`process_output`) on a character tokenizer:
the text of the token that stopped a request (EOS or a stop token) is left out, and a stop
string may end only in the text of tokens after the first ``min_tokens`` (vLLM's rules,
``vllm/v1/engine/detokenizer.py``), for single steps and multi-step bursts alike."""

from __future__ import annotations

import pytest

from pdserve.engine.output_processor import RequestState, RequestOutput, process_output
from pdserve.types.outputs import EngineCoreOutput
from pdserve.types.sampling_params import SamplingParams
from tests.support.fake_engine_for_server import make_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok, params: SamplingParams, text: str, burst: int = 1, finish: str = "length",
        stop_token: int | None = None) -> list[RequestOutput]:
    """Feed ``text``'s tokens as core deltas of ``burst`` tokens, the last one finished with
    ``finish`` (and ``stop_token`` as its ``stop_reason``); returns the deltas up to the first
    finished one."""
    st = RequestState(tok, ids(tok, "Q:"), params)
    tokens = ids(tok, text)
    outs = []
    for i in range(0, len(tokens), burst):
        last = i + burst >= len(tokens)
        outs.append(process_output(EngineCoreOutput(
            request_id="r", new_token_ids=tokens[i : i + burst],
            finish_reason=finish if last else None,
            stop_reason=stop_token if last else None), st))
        if outs[-1].finished:
            break
    return outs


def joined(outs: list[RequestOutput]) -> tuple[str, list[int], RequestOutput]:
    return "".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids], outs[-1]


@pytest.mark.parametrize("burst", [1, 2, 4])
@pytest.mark.parametrize("stop", [[], ["zz"]])
def test_stop_token_text_is_left_out(tok, burst: int, stop: list[str]) -> None:
    """A stop token (``stop_token_ids``) ends the request: its id is in the output and the
    counts, its text is not; finish reason and stop reason are the core's."""
    stop_id = ids(tok, "P")[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=stop, stop_token_ids=[stop_id])
    text, tokens, last = joined(run(tok, params, "abcP", burst, "stop", stop_id))
    assert text == "abc"
    assert tokens == ids(tok, "abcP") and last.num_output_tokens == 4
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", stop_id)


@pytest.mark.parametrize("burst", [1, 3])
def test_eos_text_is_left_out(tok, burst: int) -> None:
    """An EOS that ends the request (``stop_reason`` None) is left out of the text even where
    it decodes to text (a model whose EOS is not a special token)."""
    params = SamplingParams(temperature=0.0, max_tokens=20)
    text, tokens, last = joined(run(tok, params, "abc.", burst, "stop"))
    assert text == "abc" and len(tokens) == 4
    assert (last.finish_reason, last.stop_reason) == ("stop", None)


def test_held_back_stop_string_prefix_comes_out_at_a_stop_token(tok) -> None:
    """Text held back as a possible stop-string start is released when a stop token ends the
    request; the stop token's text does not complete the stop string."""
    stop_id = ids(tok, "y")[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["xy"], stop_token_ids=[stop_id])
    text, _, last = joined(run(tok, params, "axy", 1, "stop", stop_id))
    assert text == "ax" and last.stop_reason == stop_id


@pytest.mark.parametrize("burst", [1, 2])
def test_length_finish_keeps_the_last_token_text(tok, burst: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3)
    text, _, last = joined(run(tok, params, "abc", burst, "length"))
    assert text == "abc" and last.finish_reason == "length"


@pytest.mark.parametrize("burst", [1, 2, 7])
@pytest.mark.parametrize("text, stop, expected, n_tokens", [
    # "." is the 3rd token: within min_tokens (3), ignored; the 5th stops the request
    ("ab.c.de", ["."], "ab.c", 5),
    # ".c" begins in the 3rd token's text and ends in the 4th's: it stops the request
    ("ab.c.de", [".c"], "ab", 4),
    # "b." ends in the 3rd token's text: never a stop; "de" ends in the 7th's
    ("ab.c.de", ["b.", "de"], "ab.c.", 7),
])
def test_stop_strings_end_only_after_min_tokens(tok, burst: int, text: str, stop: list[str],
                                                expected: str, n_tokens: int) -> None:
    """``min_tokens=3``: no stop string may end in the text of the first 3 tokens; one may
    begin there (vLLM checks stop strings once more than ``min_tokens`` tokens exist, in the
    text the later tokens added)."""
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3, stop=stop)
    out_text, tokens, last = joined(run(tok, params, text, burst, "length"))
    assert out_text == expected
    assert len(tokens) == last.num_output_tokens == n_tokens
    assert last.finish_reason == "stop" and last.stop_reason in stop
