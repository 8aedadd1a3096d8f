"""Garbage-collector set-up of a long-lived pdserve process: freeze what start-up built.

The model, the KV cache, the compiled kernels and the imported modules live as long as the
process. Moved to the collector's permanent generation (``gc.freeze``), they sit out every later
pass; left where they are, each full pass walks them: over a process with torch imported one took
about 90 ms in which no step was launched (H200, ``benchmarks/offline_throughput.py
--watch-pauses``; docs/benchmarks.md, "Piecewise CUDA graphs for steps with prefills").
"""

from __future__ import annotations

import gc


def freeze_start_up_objects() -> bool:
    """Free start-up's garbage (one full collection), then freeze every object that survives.

    Objects are frozen also when some were frozen already (on the H200 machine 375 objects were
    frozen before the engine was built; skipping the freeze then left 200k objects to two
    130-140 ms passes in one timed run). Nothing is done while the collector is off.

    Returns:
        True when nothing had been frozen before this call, so that the caller may hand
        everything back with ``gc.unfreeze()`` when it shuts down; False otherwise (a caller's
        earlier freeze is left as it is) and when the collector is off.
    """
    if not gc.isenabled():
        return False
    nothing_frozen_before = not gc.get_freeze_count()
    gc.collect()  # start-up's own garbage is freed, not frozen
    gc.freeze()
    return nothing_frozen_before
