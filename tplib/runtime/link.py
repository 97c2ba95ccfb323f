"""Measuring the link between two local processes by ping-pong.

:func:`measure_link` times round trips of several message sizes between two processes
of a fresh process group and fits ``latency + n_bytes / bandwidth`` to the one-way times
(:func:`fit_link`). The simulator prices the measured tables' sends and the gradient
all-reduce with the result, a :class:`~tplib.sim.costs.Link`.

With ``exchange`` it times instead what a ring's shift does (:mod:`tplib.nn.ring`): both
processes send a freshly written message and receive one into new memory, at once. Over
loopback the two messages' copies share the same cores, and the receive first touches
its pages, so an exchange of 8 MB takes several times the one-way time of a ping-pong
reusing its buffer; the context-parallel ring is priced with this link.
"""

from __future__ import annotations

import datetime
import queue
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tplib.runtime.pool import WorkerError, free_port
from tplib.sim.costs import Link

__all__ = ["fit_link", "measure_link"]


def _ping_pong_worker(
    rank: int,
    port: int,
    backend: str,
    sizes: list[int],
    repeats: int,
    results: Any,
    exchange: bool = False,
) -> None:
    try:
        torch.set_num_threads(1)  # copying bytes needs no thread pool
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        one_way = []
        for n in sizes:
            buf = torch.zeros(n // 4, dtype=torch.float32, device=device)
            times = []
            for i in range(repeats + 2):  # two untimed round trips set the connection up
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if exchange:
                    # As the ring does: a fresh block sent, received into new memory
                    # (whose pages the receive first touches), both ranks at once.
                    sent, got = buf.clone(), torch.empty_like(buf)
                    dist.barrier()
                t0 = time.perf_counter()
                if exchange:
                    pair = [
                        dist.P2POp(dist.isend, sent, 1 - rank),
                        dist.P2POp(dist.irecv, got, 1 - rank),
                    ]
                    for work in dist.batch_isend_irecv(pair):
                        work.wait()
                elif rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) / (1 if exchange else 2))
            # The least time: a round trip is only ever slowed down by other work.
            one_way.append(min(times))
        if rank == 0:
            results.put(("ok", one_way))
        dist.barrier()
    except BaseException:
        results.put(("error", traceback.format_exc()))


def fit_link(n_bytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """The link whose ``latency + n / bandwidth`` fits one-way times ``seconds`` of
    messages of ``n_bytes`` (at least two distinct sizes), by least squares on relative
    errors: small messages pin the latency, large ones the bandwidth, and an absolute fit
    would let the largest message's noise swamp the latency."""
    n, t = np.asarray(n_bytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(n) < 2 or len(np.unique(n)) != len(n) or len(t) != len(n) or not (t > 0).all():
        raise ValueError(
            f"fit_link needs >= 2 distinct message sizes with positive times, got "
            f"sizes {n.tolist()} and times {t.tolist()}"
        )
    order = np.argsort(n)
    n, t = n[order], t[order]
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    latency, per_byte = np.linalg.lstsq(design, np.ones_like(t), rcond=None)[0].tolist()
    # Timing noise can tilt the fit: the slope between the extreme sizes is always sane,
    # and the smallest message's time bounds the latency from above.
    if per_byte <= 0:
        per_byte = max(float(t[-1] - t[0]), 1e-12) / float(n[-1] - n[0])
    if latency <= 0:
        latency = max(float(t[0] - n[0] * per_byte), float(t[0]) / 2)
    return Link(bandwidth=1.0 / per_byte, latency=latency)


def measure_link(
    n_bytes_list: Sequence[int] = (2**10, 2**14, 2**17, 2**20, 2**22),
    repeats: int = 10,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    *,
    exchange: bool = False,
) -> Link:
    """Bandwidth (bytes/s) and latency (s) of the link between two local processes, from
    a ping-pong: the one-way time of each message size is half the least round-trip time
    over ``repeats``, and :func:`fit_link` fits them. ``backend`` "gloo" times CPU
    tensors over loopback, "nccl" GPU tensors. Takes a few seconds, mostly the two
    processes' start. With ``exchange`` the times are of both processes sending and
    receiving a message of each size at once (the ring's shift), the least of
    ``repeats``."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU) or 'nccl' (GPU)")
    sizes = sorted({4 * (int(n) // 4) for n in n_bytes_list})
    if len(sizes) < 2 or sizes[0] < 4 or repeats < 1:
        raise ValueError(
            f"n_bytes_list={list(n_bytes_list)}, repeats={repeats}: the fit needs at least two "
            "distinct message sizes of >= 4 bytes and at least one repeat"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_ping_pong_worker,
            args=(r, port, backend, sizes, repeats, results, exchange),
            daemon=True,
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        status, payload = results.get(timeout=timeout_s)
    except queue.Empty:
        raise WorkerError(f"link measurement did not finish within {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if status == "error":
        raise WorkerError(f"link measurement failed:\n{payload}")
    return fit_link(sizes, payload)
