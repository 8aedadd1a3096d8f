"""Which requests a resumed generation (the proxy's mid-stream migration) can continue
identically, shared by the proxy (before it migrates) and the engine (``pdserve_resume``).

A resumed request recomputes the tokens already streamed as part of its prompt and generates the
rest on another instance. That is the same answer as an uninterrupted run for greedy decoding and
for unseeded sampling (any continuation is a valid draw), but not for:

* a ``seed``: the seeded random stream of the first instance cannot be continued elsewhere;
* ``logprobs`` / ``top_logprobs``: refused rather than stitched (the completions
  ``text_offset`` and the per-token entries of the tokens held back at the seam would have to be
  rebuilt on the new instance);
* ``presence_penalty`` / ``frequency_penalty``: they count output tokens only, and the resumed
  request holds the earlier output in its prompt;
* ``n`` > 1 (several choices in one stream).
"""

from __future__ import annotations

from typing import Any


def resume_refusal(*, n: Any = None, seed: Any = None, logprobs: Any = None,
                   top_logprobs: Any = None, presence_penalty: Any = None,
                   frequency_penalty: Any = None) -> tuple[str, str] | None:
    """Why a request with these fields cannot be resumed, or None when it can.

    Returns:
        ``(field, message)``: the first field that forbids it and a sentence saying why.
    """
    if n not in (None, 1):
        return "n", "a request with n > 1 cannot be resumed"
    if seed is not None:
        return "seed", ("a seeded request cannot be resumed: its random stream cannot be "
                        "continued on another instance")
    if (logprobs is not None and logprobs is not False) or top_logprobs:
        return "logprobs", "a request with logprobs cannot be resumed"
    for name, value in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value not in (None, 0, 0.0):
            return name, (f"a request with {name} cannot be resumed: it counts output tokens, "
                          "which a resumed request holds in its prompt")
    return None
