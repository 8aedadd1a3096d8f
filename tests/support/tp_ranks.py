"""A pair of live gloo TP ranks (TP 2 on CPU) that run test functions sent to them, so that the
tests of tests/distributed share one spawn of two torch processes instead of one per test
(``tp2`` fixture of tests/distributed/conftest.py). Its own module, not the conftest, so that the
spawned ranks import exactly this file (every test directory has a ``conftest``)."""

from __future__ import annotations

import queue
import traceback

import torch
import torch.multiprocessing as mp

#: seconds a job may take on the ranks before the pair is judged stuck and killed
JOB_TIMEOUT_S = 120


def _rank_loop(rank: int, init: str, jobs, results) -> None:
    """Join the TP group as ``rank`` of 2, then run ``fn(rank, *args)`` for every job until a
    None arrives; each job's outcome goes back as ``(rank, traceback or None)``."""
    from pdserve.distributed import init_tensor_parallel
    from pdserve.distributed.parallel_state import destroy_tensor_parallel

    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, torch.device("cpu"), init)
    try:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                fn(rank, *args)
                results.put((rank, None))
            except BaseException:  # noqa: BLE001  (reported to the test, which fails)
                results.put((rank, traceback.format_exc()))
    finally:  # gloo's threads must stop before the process exits (else an abort at exit)
        destroy_tensor_parallel()


class TP2Ranks:
    """Two live gloo ranks; :meth:`run` runs a picklable ``fn(rank, *args)`` on both at once."""

    def __init__(self, init: str):
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.Queue() for _ in range(2)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_rank_loop, args=(r, init, self._jobs[r], self._results),
                                   daemon=True) for r in range(2)]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn, *args) -> None:
        """Run ``fn(rank, *args)`` on both ranks; raises AssertionError with the ranks'
        tracebacks when either raised, or when they did not finish within JOB_TIMEOUT_S (5 s
        once one of them failed); the pair is then stopped."""
        for q in self._jobs:
            q.put((fn, args))
        failures = {}
        try:
            for _ in range(2):
                # once a rank failed, the other may be waiting in a collective forever
                rank, tb = self._results.get(timeout=5 if failures else JOB_TIMEOUT_S)
                if tb is not None:
                    failures[rank] = tb
        except queue.Empty:
            failures["timeout"] = "a rank did not finish"
        if failures:
            self.stop()
            raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items()))

    def stop(self) -> None:
        """Stop both ranks (asked first, killed if they do not exit)."""
        self.broken = True
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
