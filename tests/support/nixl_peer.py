"""A NIXL connector worker side in its own process, driven by a test over a pipe.

Run as ``python nixl_peer.py ADDRESS AUTHKEY_HEX SPEC_JSON``; the process connects back to
ADDRESS (a ``multiprocessing.connection.Listener`` in the test) and serves commands until
``shutdown``. The KV cache is ``[num_blocks, L, 2, H, B, D]`` float32 (on CPU unless
``device`` says otherwise), and block ``i``
initially holds ``i * 1000 + arange`` (or zeros with ``"zeros": true``), so a test can tell
which remote block landed where.

One TP rank of an instance: with ``"tp": {"rank", "size", "init_method"}`` the process joins a
gloo group of its instance's ranks, builds its worker side with a ``TPRank`` whose
``all_gather`` is ``dist.all_gather_object``, and its cache holds its KV heads of the global
``[num_blocks, L, 2, total_num_kv_heads, B, D]`` tensor :func:`tp_pattern` (every element its
flat index + 1).

:class:`PeerProcess` is the test-side handle; :class:`TPGroup` starts the ranks of one instance.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()

#: The KV cache geometry of a one-rank peer in most process tests: 32 blocks of 4 tokens, 2
#: layers, 2 KV heads of 8 elements (float32: 1 KiB per block).
GEOMETRY = {"num_blocks": 32, "block_size": 4, "num_layers": 2, "num_kv_heads": 2,
            "head_dim": 8, "model": "tiny"}


def peer_config(role: str, **extra: Any) -> dict[str, Any]:
    """A NIXL ``kv_transfer_config`` for a peer: ``role`` (``"kv_producer"`` or
    ``"kv_consumer"``), a 2 s handshake timeout and a 0.5 s metrics log interval, which
    ``extra`` (more ``kv_connector_extra_config`` keys) may override."""
    ex: dict[str, Any] = {"kv_handshake_timeout": 2.0, "kv_metrics_log_interval": 0.5}
    ex.update(extra)
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": ex}


def block_pattern(block_id: int, numel: int):
    """The initial content of block ``block_id`` (float32, ``numel`` values)."""
    import torch

    return torch.arange(numel, dtype=torch.float32) + float(block_id * 1000)


def tp_pattern(geometry: dict[str, Any]):
    """The global KV of a TP test instance, ``[num_blocks, L, 2, H, B, D]`` float32: every
    element is its flat index + 1 (so it encodes block, layer, K/V, global head, token)."""
    import torch

    g = geometry
    shape = (g["num_blocks"], g["num_layers"], 2, g["total_num_kv_heads"], g["block_size"],
             g["head_dim"])
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32) + 1).reshape(shape)


def _tp_rank(tp: dict[str, Any] | None):
    """The worker's TPRank (a gloo group of the instance's ranks when ``tp`` is given)."""
    from pdserve.kv_transfer.base import TPRank

    if not tp:
        return TPRank()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=tp["init_method"], rank=tp["rank"],
                            world_size=tp["size"])

    def all_gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * tp["size"]
        dist.all_gather_object(out, obj)
        return out

    return TPRank(tp["rank"], tp["size"], all_gather)


def _serve(address: str, authkey: bytes, spec: dict[str, Any]) -> None:
    os.environ["PDSERVE_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["PDSERVE_NIXL_SIDE_CHANNEL_PORT"] = str(spec["port"])
    import torch

    torch.set_num_threads(1)
    from pdserve.kv_transfer.base import KVCacheSpec
    from pdserve.types.kv_transfer_config import KVTransferConfig
    from pdserve.kv_transfer.factory import create_connector
    from pdserve.kv_transfer.nixl.tp_plan import rank_heads

    conn = Client(address, authkey=authkey)
    try:
        config = KVTransferConfig.from_dict(spec["config"])
        tp = _tp_rank(spec.get("tp"))
        worker = create_connector(config, "worker", tp=tp)
    except Exception as e:  # report start-up errors to the test
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    g = spec["geometry"]
    total = g.get("total_num_kv_heads", 0)
    heads = rank_heads(total, tp.size, tp.rank) if total else None
    kv_spec = KVCacheSpec(
        num_blocks=g["num_blocks"], block_size=g["block_size"], num_layers=g["num_layers"],
        num_kv_heads=heads.count if heads else g["num_kv_heads"], head_dim=g["head_dim"],
        dtype="float32", element_size=4, model_name=g.get("model", "tiny"),
        total_num_kv_heads=total,
    )
    shape = (kv_spec.num_blocks, kv_spec.num_layers, 2, kv_spec.num_kv_heads,
             kv_spec.block_size, kv_spec.head_dim)
    device = spec.get("device", "cpu")
    kv = torch.zeros(shape, dtype=torch.float32, device=device)
    per_block = kv[0].numel()
    if spec.get("zeros"):
        pass
    elif heads is not None:
        kv.copy_(tp_pattern(g)[:, :, :, heads.start:heads.start + heads.count])
    else:
        for i in range(kv_spec.num_blocks):
            kv[i].view(-1).copy_(block_pattern(i, per_block).to(device))
    try:
        worker.register_kv_cache(kv, kv_spec)
    except Exception as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"ok": True, "engine_id": config.engine_id, "port": worker.side_channel_port,
               "num_blocks": kv_spec.num_blocks})
    while True:
        cmd, arg = conn.recv()
        if cmd == "bind":
            worker.bind_connector_metadata(arg)
            conn.send(None)
        elif cmd == "step":
            worker.start_load_kv()
            out = worker.get_finished(set())
            conn.send({
                "finished_sending": sorted(out.finished_sending),
                "finished_recving": sorted(out.finished_recving),
                "invalid_block_ids": sorted(out.invalid_block_ids),
                "first_tokens": dict(out.first_tokens),
                "demoted_turns": sorted(out.demoted_turns),
                "kept_turns": sorted(out.kept_turns),
                "turns_to_restore": sorted(out.turns_to_restore),
                "restored_turns": sorted(out.restored_turns),
                "failed_turns": sorted(out.failed_turns),
                "load_errors": {r: e.reason.name for r, e in out.load_errors.items()},
                "load_error_details": {r: e.detail for r, e in out.load_errors.items()},
                "partial_loads": dict(out.partial_loads),
                "stats": out.stats,
                "pending": worker.has_pending_work(),
                "num_leases": len(worker.leases),
                "next_poll_in": worker.next_poll_in(),
            })
        elif cmd == "wait_wakeup":  # block until a wake-up handle is readable (or timeout)
            import zmq

            poller = zmq.Poller()
            for h in worker.wakeup_handles():
                poller.register(h, zmq.POLLIN)
            woke = bool(poller.poll(int(arg * 1000)))
            if woke:
                worker.handle_wakeup()
            conn.send({"woke": woke, "next_poll_in": worker.next_poll_in()})
        elif cmd == "blocks":
            conn.send([kv[i].reshape(-1).cpu().numpy().copy() for i in arg])  # plain pickling
        elif cmd == "shutdown":
            worker.shutdown()
            conn.send(None)
            return


class PeerProcess:
    """Starts :func:`_serve` in a subprocess and sends it commands.

    Args:
        config: ``--kv-transfer-config`` dict for the peer.
        port: its side-channel port.
        geometry: ``num_blocks, block_size, num_layers, num_kv_heads, head_dim`` (+ ``model``).
        zeros: start with an all-zero KV cache.
        device: torch device of the KV cache (``"cpu"``, ``"cuda:1"``, ...).
        tp: ``{"rank", "size", "init_method"}`` for one rank of a TP instance (see the module
            docstring), or None.
        wait: wait for the peer's hello (registration done); a TP group's ranks register
            together, so :class:`TPGroup` starts them all first and waits afterwards.
    """

    def __init__(self, config: dict[str, Any], port: int, geometry: dict[str, Any],
                 zeros: bool = False, timeout_s: float = 60.0, device: str = "cpu",
                 tp: dict[str, Any] | None = None, wait: bool = True):
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = {"config": config, "port": port, "geometry": geometry, "zeros": zeros,
                "device": device, "tp": tp}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), repr(self._listener.address), authkey.hex(),
             json.dumps(spec)],
        )
        self._listener._listener._socket.settimeout(timeout_s)
        try:
            self.conn = self._listener.accept()
        except Exception:
            self.kill()
            raise
        self.geometry = geometry
        self.hello: dict[str, Any] = {}
        if wait:
            self.wait_hello(timeout_s)

    def wait_hello(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait for the peer's hello (``{"ok": ...}`` after registration, or ``{"error"}``)."""
        if not self.hello:
            if not self.conn.poll(timeout_s):
                raise TimeoutError(f"peer did not register its KV cache within {timeout_s} s")
            self.hello = self.conn.recv()
        return self.hello

    @property
    def engine_id(self) -> str:
        return self.hello["engine_id"]

    @property
    def port(self) -> int:
        return self.hello["port"]

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 60.0) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout_s} s")
        return self.conn.recv()

    def bind(self, metadata: Any) -> None:
        self.call("bind", metadata)

    def step(self) -> dict[str, Any]:
        return self.call("step")

    def step_until(self, predicate, timeout_s: float = 20.0, acc: dict | None = None) -> dict:
        """Step until ``predicate(accumulated)`` holds; returns the accumulated report
        (sets of ids and the list of stats dicts)."""
        acc = acc if acc is not None else {
            "finished_sending": set(), "finished_recving": set(), "invalid_block_ids": set(),
            "stats": [], "first_tokens": {},
        }
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.step()
            for key in ("finished_sending", "finished_recving", "invalid_block_ids",
                        "first_tokens"):
                acc[key].update(out[key])
            acc.setdefault("load_errors", {}).update(out.get("load_errors", {}))
            acc.setdefault("partial_loads", {}).update(out.get("partial_loads", {}))
            if out["stats"]:
                acc["stats"].append(out["stats"])
            acc["last"] = out
            if predicate(acc):
                return acc
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout_s} s; got {acc}")
            time.sleep(0.005)

    def wait_wakeup(self, timeout_s: float) -> dict[str, Any]:
        """Block until one of the worker's wake-up handles is readable (then consume it), at
        most ``timeout_s``; returns ``{"woke": bool, "next_poll_in": seconds or None}``."""
        return self.call("wait_wakeup", timeout_s, timeout_s=timeout_s + 60)

    def blocks(self, ids: list[int]):
        """The content of local blocks ``ids`` as flat float32 tensors."""
        import torch

        return [torch.from_numpy(a) for a in self.call("blocks", ids)]

    def shutdown(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("shutdown", timeout_s=10)
        except Exception:
            pass
        self.kill()

    def kill(self, sig: int | None = None) -> None:
        """Stop the process (SIGTERM, or ``sig``), SIGKILL if it does not exit in 5 s."""
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._listener.close()


class TPGroup:
    """The ranks of one TP instance, each a :class:`PeerProcess`; rank 0 hosts the side
    channel at ``port``.

    Args:
        config: ``--kv-transfer-config`` dict of the instance.
        port: its side-channel port.
        geometry: as for :class:`PeerProcess`, with ``total_num_kv_heads``.
        size: the TP size.
        zeros: start with all-zero KV caches.
    """

    def __init__(self, config: dict[str, Any], port: int, geometry: dict[str, Any],
                 size: int, zeros: bool = False):
        import tempfile

        # a file store: no port to race for
        self._store_dir = tempfile.TemporaryDirectory(prefix="pdserve-tp-")
        init_method = f"file://{self._store_dir.name}/store"
        self.size = size
        self.ranks: list[PeerProcess] = []
        self.reset()
        try:
            for rank in range(size):
                self.ranks.append(PeerProcess(
                    config, port, geometry, zeros=zeros, wait=False,
                    tp={"rank": rank, "size": size, "init_method": init_method}))
            for peer in self.ranks:
                hello = peer.wait_hello()
                if not hello.get("ok"):
                    raise RuntimeError(f"TP rank failed to start: {hello}")
        except BaseException:
            self.shutdown()
            raise

    @property
    def engine_id(self) -> str:
        return self.ranks[0].engine_id

    @property
    def port(self) -> int:
        return self.ranks[0].port

    def bind(self, metadata: Any) -> None:
        """Bind the same step metadata on every rank (one scheduler drives them all)."""
        for peer in self.ranks:
            peer.bind(metadata)

    def reset(self) -> None:
        """Start new accumulated reports (see :meth:`step`)."""
        self.accs = [{"finished_sending": set(), "finished_recving": set(),
                      "invalid_block_ids": set(), "stats": [], "first_tokens": {},
                      "load_errors": {}, "counts": {}} for _ in self.ranks]

    def step(self) -> None:
        """Step every rank once, adding to the accumulated reports ``self.accs`` (one per
        rank, like :meth:`PeerProcess.step_until`'s; ``counts`` counts how often each request
        was reported per key)."""
        for peer, acc in zip(self.ranks, self.accs):
            out = peer.step()
            for key in ("finished_sending", "finished_recving"):
                for req in out[key]:
                    acc["counts"][(key, req)] = acc["counts"].get((key, req), 0) + 1
            for key in ("finished_sending", "finished_recving", "invalid_block_ids",
                        "first_tokens"):
                acc[key].update(out[key])
            acc["load_errors"].update(out.get("load_error_details", {}))
            if out["stats"]:
                acc["stats"].append(out["stats"])
            acc["last"] = out

    def step_until(self, predicate, others: tuple["TPGroup", ...] = (),
                   timeout_s: float = 30.0) -> list[dict]:
        """Step every rank (and the ranks of ``others``: without NIXL's progress thread an
        owner progresses the reads of its memory when it polls) until ``predicate(acc)`` holds
        for each rank's accumulated report; returns the reports."""
        deadline = time.monotonic() + timeout_s
        while True:
            for group in (self, *others):
                group.step()
            if all(predicate(acc) for acc in self.accs):
                return self.accs
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout_s} s; got {self.accs}")
            time.sleep(0.002)

    def shutdown(self) -> None:
        for peer in self.ranks:
            peer.shutdown()
        self._store_dir.cleanup()


if __name__ == "__main__":
    import ast

    addr = ast.literal_eval(sys.argv[1])
    _serve(addr, bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3]))
