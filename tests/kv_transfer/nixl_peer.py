"""A NIXL connector worker side in its own process, driven by a test over a pipe.

Run as ``python nixl_peer.py ADDRESS AUTHKEY_HEX SPEC_JSON``; the process connects back to
ADDRESS (a ``multiprocessing.connection.Listener`` in the test) and serves commands until
``shutdown``. The KV cache is ``[num_blocks, L, 2, H, B, D]`` float32 (on CPU unless
``device`` says otherwise), and block ``i``
initially holds ``i * 1000 + arange`` (or zeros with ``"zeros": true``), so a test can tell
which remote block landed where.

:class:`PeerProcess` is the test-side handle.
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


def block_pattern(block_id: int, numel: int):
    """The initial content of block ``block_id`` (float32, ``numel`` values)."""
    import torch

    return torch.arange(numel, dtype=torch.float32) + float(block_id * 1000)


def _serve(address: str, authkey: bytes, spec: dict[str, Any]) -> None:
    os.environ["PDSERVE_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["PDSERVE_NIXL_SIDE_CHANNEL_PORT"] = str(spec["port"])
    import torch

    from pdserve.kv_transfer.base import KVCacheSpec
    from pdserve.kv_transfer.config import KVTransferConfig
    from pdserve.kv_transfer.factory import create_connector

    conn = Client(address, authkey=authkey)
    try:
        config = KVTransferConfig.from_dict(spec["config"])
        worker = create_connector(config, "worker")
    except Exception as e:  # report start-up errors to the test
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    g = spec["geometry"]
    kv_spec = KVCacheSpec(
        num_blocks=g["num_blocks"], block_size=g["block_size"], num_layers=g["num_layers"],
        num_kv_heads=g["num_kv_heads"], head_dim=g["head_dim"], dtype="float32",
        element_size=4, model_name=g.get("model", "tiny"),
    )
    shape = (kv_spec.num_blocks, kv_spec.num_layers, 2, kv_spec.num_kv_heads,
             kv_spec.block_size, kv_spec.head_dim)
    device = spec.get("device", "cpu")
    kv = torch.zeros(shape, dtype=torch.float32, device=device)
    per_block = kv[0].numel()
    if not spec.get("zeros"):
        for i in range(kv_spec.num_blocks):
            kv[i].view(-1).copy_(block_pattern(i, per_block).to(device))
    worker.register_kv_cache(kv, kv_spec)
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
                "load_errors": {r: e.reason.name for r, e in out.load_errors.items()},
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
    """

    def __init__(self, config: dict[str, Any], port: int, geometry: dict[str, Any],
                 zeros: bool = False, timeout_s: float = 60.0, device: str = "cpu"):
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = {"config": config, "port": port, "geometry": geometry, "zeros": zeros,
                "device": device}
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
        self.hello = self.conn.recv()
        self.geometry = geometry

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


if __name__ == "__main__":
    import ast

    addr = ast.literal_eval(sys.argv[1])
    _serve(addr, bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3]))
