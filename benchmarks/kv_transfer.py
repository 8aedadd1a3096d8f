"""KV transfer time and bandwidth of pdserve's NIXL connector, next to a plain memory copy.

Two processes, as in a real deployment: the *owner* (a prefiller's worker side, P) keeps the
blocks of a finished prompt under a lease, and the *reader* (a decoder's worker side, D) loads
them with the real connector path (side-channel handshake once, lease claim, one asynchronous
NIXL READ, "done" notification). For each prompt length the script reports:

* ``load ms``: wall time from handing the load to D's worker until D reports it finished
  (lease-claim round trip over the side channel + READ + polling every 0.2 ms), the latency a
  request sees;
* ``xfer ms`` / ``GB/s``: NIXL's own transfer time of the READ (telemetry) and the bandwidth
  ``bytes / xfer``;
* ``descs``: descriptors after merging runs of consecutive blocks;
* ``copy ms`` / ``copy GB/s``: ``torch.Tensor.copy_`` of the same number of bytes, measured in
  the reader process in the same run (host to host on CPU; GPU0 to GPU1 with two GPUs, else
  within one GPU). With ``--layout fragmented`` the baseline is the same block gather done by
  ``index_copy_``.

* ``--prefill-tp A --decode-tp B``: the owner is ``A`` processes and the reader ``B``, one TP
  rank each (a gloo group per instance, agents exchanged at registration, each rank holding its
  KV heads of ``--num-kv-heads`` in all); every reader rank reads its head slice (docs/
  architecture.md, "KV transfer across TP sizes"). ``descs`` and ``MiB`` are then summed over the
  reader ranks, ``xfer ms`` / ``load ms`` are the slowest rank's, and the plan of the pairing
  (reads per reader rank, descriptors per request) is printed first. On CUDA rank ``r`` of P uses
  GPU ``r`` and rank ``r`` of D GPU ``A + r`` (modulo the GPUs present).

* ``path``: what carried the reads and the memory read into (``cuda_ipc/VRAM``: pdserve's
  same-GPU copy; ``nixl/VRAM``: a NIXL READ, UCX choosing the transport; ``nixl/DRAM``: a NIXL
  READ of host memory, e.g. host-buffer mode); ``--same-host-transport`` and
  ``--kv-buffer-device cpu`` choose.

The KV geometry is SmolLM2-135M's (30 layers, 3 KV heads, head size 64) by default, an 8B
Llama-class one with ``--geometry llama-8b``, Qwen3-0.6B's with ``--geometry qwen3-0.6b``,
DeepSeek-V2-Lite's multi-head latent with ``--geometry deepseek-v2-lite`` (a latent cache,
replicated on every TP rank: each reader rank reads it once, whole, from one owner rank, so a
rank's ``descs`` are those of a TP-1 read), or anything with ``--num-layers`` etc. With ``--same-gpu`` both processes use ``cuda:0`` even when
there are more GPUs (the one-GPU P/D case). Blocks are
taken contiguously (``--layout contiguous``: one descriptor per request) or as a random
permutation (``--layout fragmented``: about one descriptor per block, the worst case of docs/architecture.md, "KV cache layout").

Examples::

    python benchmarks/kv_transfer.py                          # CPU, 128 .. 32k tokens
    python benchmarks/kv_transfer.py --lengths 128,1024 --repeats 3
    python benchmarks/kv_transfer.py --device cuda --geometry llama-8b --layout fragmented
    python benchmarks/kv_transfer.py --device cuda --same-gpu --geometry qwen3-0.6b \
        --lengths 4096 --same-host-transport nixl       # force NIXL between two processes
    python benchmarks/kv_transfer.py --prefill-tp 2 --decode-tp 1 --lengths 512,2048
    python benchmarks/kv_transfer.py --geometry deepseek-v2-lite --prefill-tp 1 --decode-tp 2
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_transfer_plan import DTYPE_BYTES, GEOMETRIES, print_plan  # noqa: E402

POLL_INTERVAL_S = 0.0002  # reader's pause between connector polls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(tp: dict[str, Any]):
    """The worker's TPRank: a gloo group over the instance's ranks when its size is > 1."""
    from pdserve.kv_transfer.base import TPRank

    if tp["size"] == 1:
        return TPRank()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=tp["init_method"], rank=tp["rank"],
                            world_size=tp["size"])

    def all_gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * tp["size"]
        dist.all_gather_object(out, obj)
        return out

    return TPRank(tp["rank"], tp["size"], all_gather)


def _make_worker(role: str, port: int, device: str, geo: dict[str, Any], num_blocks: int,
                 same_host_transport: str = "auto", kv_buffer_device: str = "auto",
                 tp: dict[str, Any] | None = None):
    """A NIXL worker side with a registered KV cache ``[num_blocks, L, 2, H, B, D]`` (``H``:
    this TP rank's KV heads)."""
    os.environ["PDSERVE_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["PDSERVE_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    import torch

    from pdserve.kv_transfer.base import KVCacheSpec
    from pdserve.types.kv_transfer_config import KVTransferConfig
    from pdserve.kv_transfer.factory import create_connector
    from pdserve.kv_transfer.nixl.tp_plan import rank_heads
    from pdserve.types.kv_cache_kind import KVCacheKind

    tp = tp or {"rank": 0, "size": 1}
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    tp_rank = _tp_rank(tp)
    heads = rank_heads(geo["num_kv_heads"], tp["size"], tp["rank"])
    dtype = getattr(torch, geo["dtype"])
    spec = KVCacheSpec(num_blocks=num_blocks, block_size=geo["block_size"],
                       num_layers=geo["num_layers"], num_kv_heads=heads.count,
                       head_dim=geo["head_dim"], dtype=geo["dtype"],
                       element_size=DTYPE_BYTES[geo["dtype"]], model_name="bench",
                       total_num_kv_heads=geo["num_kv_heads"],
                       kind=KVCacheKind(geo.get("kind", "per_head")))
    kv = torch.empty((num_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_size,
                      spec.head_dim), dtype=dtype, device=device)
    if role == "owner":
        kv.view(num_blocks, -1).copy_(
            torch.arange(num_blocks, device=device, dtype=torch.float32).to(dtype)[:, None]
            .expand(num_blocks, kv[0].numel()))
    else:
        kv.zero_()
    cfg = KVTransferConfig.from_dict({
        "kv_role": "kv_producer" if role == "owner" else "kv_consumer",
        "kv_buffer_device": kv_buffer_device,
        "engine_id": f"bench-{role}",
        "kv_connector_extra_config": {"kv_lease_duration": 600, "kv_metrics_log_interval": 1e9,
                                      "same_host_transport": same_host_transport,
                                      # on CPU the owner progresses reads when it polls (below)
                                      "nixl_progress_thread": device != "cpu"},
    })
    worker = create_connector(cfg, "worker", tp=tp_rank)
    worker.register_kv_cache(kv, spec)
    return worker, kv, spec, cfg.engine_id


def _owner_main(conn, port: int, device: str, geo: dict[str, Any], num_blocks: int,
                same_host_transport: str, kv_buffer_device: str,
                tp: dict[str, Any] | None = None) -> None:
    from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, SendSpec

    worker, _, _, engine_id = _make_worker("owner", port, device, geo, num_blocks,
                                           same_host_transport, kv_buffer_device, tp)
    conn.send(engine_id)
    released: set[str] = set()  # leases that ended, from every poll

    def poll() -> None:
        released.update(worker.get_finished(set()).finished_sending)

    while True:
        # between commands the owner keeps polling like an engine: rank 0 forwards the
        # side-channel notices of its sibling ranks, which leave only while it polls
        while not conn.poll(POLL_INTERVAL_S):
            poll()
        cmd, arg = conn.recv()
        if cmd == "lease":
            request_id, block_ids = arg
            worker.bind_connector_metadata(NixlConnectorMetadata(
                reqs_to_send={request_id: SendSpec(request_id, block_ids, 600.0)}))
            poll()
            while request_id not in worker.leases:  # host-buffer mode: leased once staged
                time.sleep(0.0002)
                poll()
            conn.send(None)
        elif cmd == "wait_released":
            deadline = time.monotonic() + 60
            while arg not in released:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lease {arg} not released")
                time.sleep(POLL_INTERVAL_S)
                poll()
            conn.send(None)
        elif cmd == "stop":
            worker.shutdown()
            conn.send(None)
            return


def _reader_main(conn, port: int, device: str, copy_device: str, geo: dict[str, Any],
                 num_blocks: int, same_host_transport: str, kv_buffer_device: str,
                 tp: dict[str, Any] | None = None) -> None:
    import torch

    from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec
    from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

    worker, kv, spec, _ = _make_worker("reader", port, device, geo, num_blocks,
                                       same_host_transport, kv_buffer_device, tp)
    conn.send(None)
    path = "?"  # the read path of the owner, reported once after the handshake

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
            torch.cuda.synchronize(copy_device)

    while True:
        cmd, arg = conn.recv()
        if cmd == "read":
            owner_id, owner_port, request_id, remote_ids, local_ids = arg
            ref = RemoteKVRef(RemoteEndpoint(owner_id, "127.0.0.1", owner_port), request_id, remote_ids)
            meta = NixlConnectorMetadata(reqs_to_recv={
                "r-" + request_id: RecvSpec("r-" + request_id, ref, local_ids, remote_ids,
                                        num_tokens=len(local_ids) * spec.block_size)})
            t0 = time.perf_counter()
            worker.bind_connector_metadata(meta)
            stats = None
            while True:
                worker.start_load_kv()
                out = worker.get_finished(set())
                if out.stats:
                    stats = out.stats
                    for entry in (out.stats.get("transfer_paths") or {}).values():
                        path = f"{entry['transport']}/{entry['mem'].split('->')[-1]}"
                if "r-" + request_id in out.finished_recving:
                    break
                # like the engine loop, wait a little between polls: a busy loop would starve
                # the side-channel thread of the GIL and inflate the claim round trip
                time.sleep(POLL_INTERVAL_S)
            load_s = time.perf_counter() - t0
            # the "done" notices of owner ranks no READ carried (an owner rank nobody reads,
            # e.g. the second replica of a latent) leave while the worker polls, as in the engine
            while worker.notices.has_queued() or worker.notices.has_background():
                worker.get_finished(set())
                time.sleep(POLL_INTERVAL_S)
            if out.invalid_block_ids or not stats or not stats["xfer_time_s"]:
                raise RuntimeError(f"transfer failed: {out}")
            # spot-check the data: block i of the owner holds the value i
            for lid, rid in list(zip(local_ids, remote_ids))[:: max(1, len(local_ids) // 8)]:
                if float(kv[lid].flatten()[0]) != float(torch.tensor(rid).to(kv.dtype)):
                    raise RuntimeError(f"block {lid} does not hold remote block {rid}")
            conn.send({"load_s": load_s, "xfer_s": stats["xfer_time_s"][0],
                       "post_s": stats["post_time_s"][0], "bytes": stats["bytes"][0],
                       "descs": stats["num_descriptors"][0], "path": path})
        elif cmd == "copy_bytes":  # the baseline: one copy_ of the bytes all ranks read
            nbytes, repeats = arg
            n = max(1, nbytes // kv.element_size())
            src = torch.ones(n, dtype=kv.dtype, device=copy_device)
            dst = torch.empty(n, dtype=kv.dtype, device=device)
            times = []
            for _ in range(repeats + 1):  # the first one warms up
                sync()
                t0 = time.perf_counter()
                dst.copy_(src)
                sync()
                times.append(time.perf_counter() - t0)
            del src, dst
            conn.send(statistics.median(times[1:]))
        elif cmd == "copy":
            n_blocks, fragmented, repeats = arg
            block_elems = kv[0].numel()
            src = torch.empty((n_blocks if not fragmented else num_blocks, block_elems),
                              dtype=kv.dtype, device=copy_device)
            dst = torch.empty((n_blocks if not fragmented else num_blocks, block_elems),
                              dtype=kv.dtype, device=device)
            src_ids = torch.randperm(src.shape[0], device=copy_device)[:n_blocks]
            dst_ids = torch.randperm(dst.shape[0], device=device)[:n_blocks]
            times = []
            for _ in range(repeats + 1):  # the first one warms up
                sync()
                t0 = time.perf_counter()
                if fragmented:
                    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(device))
                else:
                    dst.copy_(src)
                sync()
                times.append(time.perf_counter() - t0)
            del src, dst
            conn.send(statistics.median(times[1:]))
        elif cmd == "stop":
            worker.shutdown()
            conn.send(None)
            return


def _pick_devices(device: str, same_gpu: bool = False, prefill_tp: int = 1,
                  decode_tp: int = 1) -> tuple[list[str], list[str], str]:
    """(owner devices by rank, reader devices by rank, baseline-copy source device)."""
    if device == "cpu":
        return ["cpu"] * prefill_tp, ["cpu"] * decode_tp, "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    count = torch.cuda.device_count()
    if prefill_tp == decode_tp == 1:
        if count >= 2 and not same_gpu:
            return ["cuda:0"], ["cuda:1"], "cuda:0"
        return ["cuda:0"], ["cuda:0"], "cuda:0"
    owners = [f"cuda:{r % count}" for r in range(prefill_tp)]
    readers = [f"cuda:{(0 if same_gpu else prefill_tp + r) % count}" for r in range(decode_tp)]
    return owners, readers, owners[0]


def _start_group(ctx, target, devices: list[str], port: int, *args: Any) -> list[tuple[Any, Any]]:
    """Start one process per TP rank of an instance (``target(conn, port, device, *args,
    tp)``); returns ``(process, connection)`` by rank."""
    import tempfile

    store = tempfile.mkdtemp(prefix="pdserve-bench-tp-")
    out = []
    for rank, device in enumerate(devices):
        parent, child = ctx.Pipe()
        tp = {"rank": rank, "size": len(devices), "init_method": f"file://{store}/store"}
        proc = ctx.Process(target=target, args=(child, port, device, *args, tp))
        proc.start()
        out.append((proc, parent))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--num-kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--lengths", default="128,512,2048,8192,32768",
                    help="comma-separated prompt lengths in tokens")
    ap.add_argument("--layout", choices=["contiguous", "fragmented"], default="contiguous")
    ap.add_argument("--repeats", type=int, default=5, help="transfers per length (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--same-gpu", action="store_true",
                    help="owner and reader both on cuda:0 (P and D sharing one GPU)")
    ap.add_argument("--same-host-transport", choices=["auto", "cuda_ipc", "nixl"],
                    default="auto", help="kv_connector_extra_config.same_host_transport")
    ap.add_argument("--kv-buffer-device", choices=["auto", "cpu"], default="auto",
                    help="cpu with CUDA caches: host-buffer mode (NIXL moves pinned host "
                         "mirrors; the time includes the copy to the GPU)")
    ap.add_argument("--prefill-tp", type=int, default=1, help="TP ranks of the owner (P)")
    ap.add_argument("--decode-tp", type=int, default=1, help="TP ranks of the reader (D)")
    args = ap.parse_args(argv)
    if args.prefill_tp < 1 or args.decode_tp < 1:
        ap.error("--prefill-tp and --decode-tp must be at least 1")

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    owner_devs, reader_devs, copy_dev = _pick_devices(device, args.same_gpu, args.prefill_tp,
                                                      args.decode_tp)
    geo = dict(GEOMETRIES[args.geometry], dtype=args.dtype, block_size=args.block_size)
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        if getattr(args, key) is not None:
            geo[key] = getattr(args, key)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    max_blocks = math.ceil(max(lengths) / args.block_size)
    num_blocks = max_blocks * (2 if args.layout == "fragmented" else 1) + 1
    block_bytes = (geo["num_layers"] * 2 * geo["num_kv_heads"] * args.block_size
                   * geo["head_dim"] * DTYPE_BYTES[args.dtype])
    print(f"# KV geometry: {geo} -> {block_bytes / 1024:.1f} KiB per block, "
          f"{block_bytes / args.block_size / 1024:.1f} KiB per token "
          f"({'each TP rank: replicated' if geo.get('kind') == 'mla_latent' else 'all TP ranks'})")
    print_plan(geo["num_kv_heads"], args.prefill_tp, args.decode_tp, geo["num_layers"],
                geo.get("kind", "per_head"))
    print(f"# owner on {','.join(owner_devs)}, reader on {','.join(reader_devs)}; {num_blocks} "
          f"blocks per side ({num_blocks * block_bytes / 2**30:.2f} GiB over all ranks); layout "
          f"{args.layout}; median of {args.repeats}; same_host_transport "
          f"{args.same_host_transport}, kv_buffer_device {args.kv_buffer_device}")

    ctx = mp.get_context("spawn")
    owner_port, reader_port = _free_port(), _free_port()
    common = (geo, num_blocks, args.same_host_transport, args.kv_buffer_device)
    owners = _start_group(ctx, _owner_main, owner_devs, owner_port, *common)
    readers = _start_group(ctx, _reader_main, reader_devs, reader_port, copy_dev, *common)
    owner_conns = [c for _, c in owners]
    reader_conns = [c for _, c in readers]

    def ask(conns: list[Any], cmd: str, arg: Any) -> list[Any]:
        for conn in conns:
            conn.send((cmd, arg))
        return [conn.recv() for conn in conns]

    rng = random.Random(args.seed)
    try:
        owner_id = [c.recv() for c in owner_conns][0]
        for conn in reader_conns:
            conn.recv()
        header = (f"{'tokens':>7} {'MiB':>9} {'descs':>6} {'load ms':>9} {'xfer ms':>9} "
                  f"{'GB/s':>7} {'post ms':>8} {'copy ms':>9} {'copy GB/s':>9} {'of copy':>8} "
                  f"{'path':>13}")
        print(header)
        counter = 0
        for length in lengths:
            n = math.ceil(length / args.block_size)
            rows = []
            for rep in range(args.repeats + 1):  # the first one includes the handshake
                if args.layout == "contiguous":
                    remote_ids, local_ids = list(range(n)), list(range(1, n + 1))
                else:
                    remote_ids = rng.sample(range(num_blocks), n)
                    local_ids = rng.sample(range(num_blocks), n)
                counter += 1
                request_id = f"bench-{counter}"
                ask(owner_conns, "lease", (request_id, remote_ids))
                for conn in owner_conns:  # the owners poll until their leases end
                    conn.send(("wait_released", request_id))
                ranks = ask(reader_conns, "read",
                            (owner_id, owner_port, request_id, remote_ids, local_ids))
                for conn in owner_conns:
                    conn.recv()
                row = {"load_s": max(r["load_s"] for r in ranks),
                       "xfer_s": max(r["xfer_s"] for r in ranks),
                       "post_s": max(r["post_s"] for r in ranks),
                       "bytes": sum(r["bytes"] for r in ranks),
                       "descs": sum(r["descs"] for r in ranks), "path": ranks[0]["path"]}
                if rep > 0 or args.repeats == 0:
                    rows.append(row)
            nbytes = rows[0]["bytes"]
            if args.prefill_tp == args.decode_tp == 1:
                reader_conns[0].send(("copy", (n, args.layout == "fragmented", args.repeats)))
            else:
                reader_conns[0].send(("copy_bytes", (nbytes, args.repeats)))
            copy_s = reader_conns[0].recv()
            med = {k: statistics.median(r[k] for r in rows) for k in ("load_s", "xfer_s", "post_s")}
            descs = statistics.median(r["descs"] for r in rows)
            print(f"{length:>7} {nbytes / 2**20:>9.2f} {descs:>6.0f} {1e3 * med['load_s']:>9.3f} "
                  f"{1e3 * med['xfer_s']:>9.3f} {nbytes / med['xfer_s'] / 1e9:>7.2f} "
                  f"{1e3 * med['post_s']:>8.3f} {1e3 * copy_s:>9.3f} "
                  f"{nbytes / copy_s / 1e9:>9.2f} {copy_s / med['xfer_s']:>8.1%} "
                  f"{rows[-1]['path']:>13}", flush=True)
    finally:
        for conn in owner_conns + reader_conns:
            try:
                conn.send(("stop", None))
                conn.recv()
            except (OSError, EOFError):
                pass
        for proc, _ in owners + readers:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
