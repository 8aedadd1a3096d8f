"""Host block tables kept between decode steps (pdserve/runner/block_tables.py) and the inputs
that a replayed decode step builds from them (pdserve/runner/decode_graphs.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve.types.outputs import PLACEHOLDER_TOKEN, ScheduledRequest
from pdserve.types.sampling_params import SamplingParams
from pdserve.runner.block_tables import DecodeBlockTables
from pdserve.runner.decode_graphs import DecodeGraphReplay
from pdserve.runner.device_tokens import DeviceTokens

BS = 4


def _req(rid: str, n: int, blocks: list[int], token: int = 7, fed: bool = False):
    return ScheduledRequest(request_id=rid, token_ids=[PLACEHOLDER_TOKEN if fed else token],
                            num_computed_tokens=n, block_ids=blocks, sample=True,
                            sampling_params=SamplingParams(), prompt_token_ids=[1],
                            output_token_ids=[], input_from_previous_step=fed)


def _reference(block_lists: list[list[int]], width: int) -> np.ndarray:
    """The padded ``[B, widest]`` table of the lists cut to ``width``."""
    widest = max(min(len(b), width) for b in block_lists)
    out = np.zeros((len(block_lists), widest), dtype=np.int32)
    for i, b in enumerate(block_lists):
        out[i, :min(len(b), width)] = b[:width]
    return out


def _table(tables: DecodeBlockTables, reqs) -> np.ndarray:
    index, num_blocks = tables.rows(reqs)
    assert num_blocks.tolist() == [min(len(r.block_ids), tables.width) for r in reqs]
    return tables.table(index, int(num_blocks.max()))


def test_rows_follow_appends_rewrites_and_reused_ids():
    rng = random.Random(0)
    width = 12
    tables = DecodeBlockTables(width)
    live: dict[str, list[int]] = {}
    next_id = 0
    for step in range(300):
        # new requests, appended blocks, preemptions (a new list), lists changed in place,
        # finished requests and ids used again with other blocks
        if len(live) < 40 or rng.random() < 0.3:
            rid = f"r{rng.randrange(next_id + 1)}" if rng.random() < 0.2 else f"r{next_id}"
            next_id += 1
            live[rid] = [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
        for rid in list(live):
            u = rng.random()
            if u < 0.1:
                live[rid].append(rng.randrange(1000))
            elif u < 0.12:
                live[rid] = [rng.randrange(1000) for _ in range(rng.randint(1, 15))]
            elif u < 0.14:
                live[rid][rng.randrange(len(live[rid]))] = rng.randrange(1000)
            elif u < 0.15:
                del live[rid][rng.randrange(len(live[rid])):]
                live[rid] = live[rid] or [5]
            elif u < 0.17:
                del live[rid]
        batch = rng.sample(sorted(live), min(len(live), rng.randint(1, 50)))
        reqs = [_req(rid, 0, live[rid]) for rid in batch]
        got = _table(tables, reqs)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, _reference([live[rid] for rid in batch], width))
    assert tables.num_rows <= 4 * 50  # rows of absent requests were evicted


def test_pickled_lists_and_rows_cut_to_width():
    tables = DecodeBlockTables(3)
    a = [1, 2, 3, 4, 5]
    for blocks in (a, list(a), a + [6], [9]):
        np.testing.assert_array_equal(_table(tables, [_req("x", 0, blocks)]),
                                      _reference([blocks], 3))
    with pytest.raises(ValueError):
        DecodeBlockTables(0)


class _RecordingGraphs:
    """A decode graph whose run() returns its inputs."""

    def run(self, inputs):
        return {k: v.clone() for k, v in inputs.items()}


def _replay(max_model_len: int = 64) -> DecodeGraphReplay:
    width = -(-max_model_len // BS)
    return DecodeGraphReplay(DecodeBlockTables(width), BS, max_model_len, torch.device("cpu"))


def test_replay_inputs_equal_those_built_from_the_lists():
    rng = random.Random(1)
    replay = _replay()
    previous = DeviceTokens({"a": 1, "c": 0}, torch.tensor([50, 51]))
    for _ in range(20):
        reqs = []
        for rid in ("a", "b", "c", "d"):
            n = rng.randrange(63)
            blocks = [rng.randrange(100) for _ in range(n // BS + 1 + rng.randrange(3))]
            reqs.append(_req(rid, n, blocks, token=rng.randrange(9), fed=rid in ("a", "c")))
        inp = replay.replay(reqs, _RecordingGraphs(), previous)
        ns = [r.num_computed_tokens for r in reqs]
        assert inp["input_ids"].tolist() == [51, reqs[1].token_ids[0], 50, reqs[3].token_ids[0]]
        assert inp["positions"].tolist() == ns
        assert inp["positions"].dtype == inp["slot_mapping"].dtype == torch.int64
        assert inp["slot_mapping"].tolist() == [r.block_ids[n // BS] * BS + n % BS
                                                for r, n in zip(reqs, ns)]
        assert inp["context_lens"].dtype == torch.int32
        assert inp["context_lens"].tolist() == [n + 1 for n in ns]
        assert inp["block_tables"].dtype == torch.int32
        np.testing.assert_array_equal(inp["block_tables"].numpy(),
                                      _reference([r.block_ids for r in reqs], 16))


def test_replay_raises_for_the_first_bad_row():
    replay = _replay(max_model_len=16)
    ok = _req("ok", 5, [1, 2])
    too_long = _req("long", 16, [1, 2, 3, 4, 5])
    short = _req("short", 8, [1, 2])
    with pytest.raises(ValueError, match="reaches 17 tokens, beyond max_model_len=16"):
        replay.replay([ok, too_long, short], _RecordingGraphs())
    with pytest.raises(ValueError, match="block table of 2 blocks cannot hold 9 tokens"):
        replay.replay([ok, short, too_long], _RecordingGraphs())
    with pytest.raises(ValueError, match="did not sample them"):
        replay.replay([_req("x", 1, [3], fed=True)], _RecordingGraphs(),
                      DeviceTokens({}, torch.zeros(0, dtype=torch.int64)))
