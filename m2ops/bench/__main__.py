"""python -m m2ops.bench: m2ops side by side with mamba_ssm's Triton kernels and TileGym's cuTile Mamba-2.

At each point of the grid (--seqlens x --dstates, with the shape options below) every peer runs the forward
pass with D and initial and final states (with --backward, also the gradients): on CUDA timed with CUDA events,
the L2 flushed before each run; the median of --runs runs after --warmup.

Each peer runs in its own worker process, replaced after any failed point; errors and timeouts are recorded
with the result. A default peer that cannot run here (its package is not installed, or it needs a CUDA device
and there is none) is skipped with a line saying why; one named in --peers is recorded as failed instead, with
that reason. With --gpus, rows (a shape with all its peers) run on several GPUs side by side, each GPU with its
own workers. Writes results.json (merged with an earlier run's under --resume), results.md (ms, each as a
multiple of the shape's bandwidth/FLOP floor, and m2ops's speedups) and speedup.png under --out.
The protocol and measured results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

from ..__main__ import Parser, device, integer
from . import peer_tuning
from .peers import PEERS, unavailable
from .pool import Pool
from .report import kernels_markdown, markdown, plot
from .shapes import grid, parse_sizes

DEFAULT_PEERS = ("m2ops", "m2ops-graph", "mamba_ssm-c64", "mamba_ssm-c128", "mamba_ssm-c256", "tilegym")


def _sizes(text: str) -> list[int]:
    """--seqlens, --dstates: 1K,4K,128 (K: times 1024)."""
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds; got {text!r}")
    return v


def _peer_list(text: str) -> list[str]:
    """--peers: comma-separated names from PEERS, each once."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                                         f"known: {', '.join(PEERS)}")
    if not peers or len(set(peers)) != len(peers):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated peers such as m2ops,tilegym; "
                                         f"got {text!r}")
    return peers


def _gpu_list(text: str) -> list[str]:
    """--gpus: comma-separated CUDA device indices (what CUDA_VISIBLE_DEVICES takes for one device)."""
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"expected distinct CUDA device indices such as 0,1; got {text!r}")
    return gpus


def _peer_points(text: str) -> tuple[str, set]:
    """--peer-points PEER=T:N,T:N: the peer runs only at those points of the grid (T with a K suffix or not)."""
    peer, sep, points = text.partition("=")
    if sep and peer not in PEERS:
        raise argparse.ArgumentTypeError(f"unknown peer {peer!r} in {text!r}; known: {', '.join(PEERS)}")
    try:
        if not sep:
            raise ValueError
        out = set()
        for point in points.split(","):
            t, n = point.split(":")
            out.add((parse_sizes(t)[0], parse_sizes(n)[0]))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected PEER=T:N[,T:N...] with positive sizes, such as tilegym-tuned=64K:64,16K:128; got {text!r}"
        ) from None
    return peer, out


def parse_args(argv=None):
    """The options, each checked here: a bad one exits with one line naming it, and code 2."""
    p = Parser(prog="python -m m2ops.bench", description=__doc__)
    pos = integer(1)
    p.add_argument("--seqlens", type=_sizes, default="1K,4K,16K,64K,256K",
                   help="tokens per row at the grid's points, comma-separated; K: times 1024")
    p.add_argument("--dstates", type=_sizes, default="64,128,256,512", help="state sizes at the grid's points")
    p.add_argument("--peers", type=_peer_list, default=None,
                   help=f"comma-separated, from: {', '.join(PEERS)} (default: {', '.join(DEFAULT_PEERS)}; of "
                        f"these, those that cannot run here are skipped)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of x, B and C (dt, A, D and the states are float32)")
    p.add_argument("--batch", type=pos, default=1, help="rows")
    p.add_argument("--nheads", type=pos, default=80, help="heads")
    p.add_argument("--headdim", type=pos, default=64, help="channels per head")
    p.add_argument("--ngroups", type=pos, default=1, help="groups of heads sharing B and C; must divide --nheads")
    # 256: the kernels' tables are tuned for it (occupancy, bfloat16 local states) and every measurement in
    # docs/benchmarks.md uses it; at 128 m2ops is up to 1.5x slower from 16K up (H200, 2026-12-01).
    p.add_argument("--chunk-size", type=pos, default=256, help="m2ops's chunk size")
    p.add_argument("--runs", type=pos, default=100, help="timed runs per point (median reported)")
    p.add_argument("--warmup", type=integer(0), default=10, help="untimed runs per point before the timed ones")
    p.add_argument("--timeout", type=_seconds, default=300.0,
                   help="seconds per point before it is recorded as a timeout")
    p.add_argument("--device", type=device, default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--gpus", type=_gpu_list, default=[],
                   help="comma-separated CUDA device indices, e.g. 0,1: each row (a shape with all its peers) runs on "
                        "one of them, the next row on whichever is free first (default: the one visible device)")
    p.add_argument("--out", default="bench-results", help="directory of the results")
    p.add_argument("--resume", action="store_true", help="keep results already in OUT/results.json")
    p.add_argument("--fresh", action="store_true",
                   help="run every peer and shape in a new process of its own (by default a peer's worker process "
                        "serves its points one after another and is replaced after any failure; --fresh costs a "
                        "process start, imports and kernel loads per point)")
    p.add_argument("--check", action="store_true",
                   help="also compare m2ops's y and final state (with --backward: its gradients) with the float32 "
                        "reference at every point")
    p.add_argument("--backward", action="store_true",
                   help="time forward+backward: gradients of x, dt, A, B, C, D and the initial state")
    p.add_argument("--peer-points", type=_peer_points, action="append", default=[], metavar="PEER=T:N,...",
                   help="run PEER only at these points of the grid, e.g. tilegym-tuned=64K:64,16K:128 (repeatable)")
    p.add_argument("--peer-tuning", default=None, metavar="FILE",
                   help="tilegym-tuned: take TileGym's search outcomes from FILE where it holds one for the shape, "
                        "GPU and versions, and add the outcome of every search it runs (a JSON file; see "
                        "m2ops/bench/peer_tuning.py)")
    p.add_argument("--kernels", action="store_true",
                   help="also record each point's time per kernel (torch profiler, after the timed runs; on the "
                        "CPU per operator) in results.json as kernel_ms, largest first")
    a = p.parse_args(argv)
    if a.nheads % a.ngroups:
        p.error(f"argument --ngroups: expected a divisor of --nheads ({a.nheads}); got {a.ngroups}")
    a.named_peers = a.peers is not None  # named by the user: never skipped silently
    if a.peers is None:
        a.peers = list(DEFAULT_PEERS)
    if a.device == "auto":
        a.device = None  # each worker takes CUDA when its process sees a device (with --gpus: its own)
    return a


def _runnable(a, say=print):
    """The peers to run here: a default one that cannot run is left out, with a line saying why; one named in
    --peers stays (its points are recorded as failed with the reason, without a worker). Returns the peers and
    {peer: reason} of those that stay but cannot run."""
    import torch
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    keep, cannot = [], {}
    for peer in a.peers:
        why = unavailable(peer, dev)
        if why is None:
            keep.append(peer)
        elif a.named_peers:
            say(f"python -m m2ops.bench: {peer} cannot run here ({why}); named in --peers, so its points are "
                f"recorded as failed")
            keep.append(peer)
            cannot[peer] = why
        else:
            say(f"python -m m2ops.bench: skipping {peer}: {why}")
    return keep, cannot


def _progress(total):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="point", file=sys.stderr)
    except ImportError:
        return None


class _Progress:
    """Results, their JSON file and the progress display, shared by the GPUs' threads."""

    def __init__(self, results, path, total):
        self.results, self.path, self.total = results, path, total
        self.lock = threading.Lock()
        self.count = 0
        self.bar = _progress(total)

    def add(self, r, msg):
        with self.lock:
            self.results.append(r)
            with open(self.path, "w") as f:  # after every point: a killed run keeps what it measured
                json.dump(self.results, f, indent=1)
            self.count += 1
            if self.bar is not None:
                self.bar.update(1)
                self.bar.write(msg)
            else:
                print(f"[{self.count}/{self.total}] {msg}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _measure(pool, a, shape, peer, mode, progress, gpu=None, cannot=None):
    job = dict(peer=peer, shape=shape.as_dict(), chunk_size=a.chunk_size, runs=a.runs, warmup=a.warmup,
               device=a.device, backward=a.backward, check=a.check, kernels=a.kernels)
    t0 = time.perf_counter()
    r = {"error": f"unavailable: {cannot}"} if cannot else pool.run(peer, job, a.timeout)
    r.update(peer=peer, key=shape.key, mode=mode, shape=shape.as_dict(), floor_ms=shape.floor_ms(backward=a.backward),
             wall_s=round(time.perf_counter() - t0, 1))
    if gpu is not None:
        r["gpu"] = gpu
    msg = (f"{peer:>15} {shape.key}" + (f" (GPU {gpu})" if gpu is not None else "") + ": "
           + (f"{r['ms']:.3f} ms" if "ms" in r else r["error"][:100]))
    progress.add(r, msg)


def _serve(rows, lock, a, mode, progress, gpu=None, cannot=None):
    """Measure rows, taken one at a time from the shared queue, until none is left."""
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    with Pool(env=env, fresh=a.fresh) as pool:
        while True:
            with lock:
                if not rows:
                    return
                shape, row_peers = rows.popleft()
            for peer in row_peers:
                _measure(pool, a, shape, peer, mode, progress, gpu, (cannot or {}).get(peer))


def main(argv=None):
    a = parse_args(argv)
    mode = "fwd+bwd" if a.backward else "fwd"
    peers, cannot = _runnable(a, say=lambda line: print(line, file=sys.stderr))
    shapes = grid(a.seqlens, a.dstates, batch=a.batch, nheads=a.nheads, headdim=a.headdim, ngroups=a.ngroups,
                  dtype=a.dtype)
    os.makedirs(a.out, exist_ok=True)
    if a.peer_tuning:  # read by the tilegym-tuned workers (peers.py)
        os.environ[peer_tuning.ENV] = os.path.abspath(a.peer_tuning)
    path = os.path.join(a.out, "results.json")
    results = []
    if a.resume and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    done = {(r["peer"], r["key"], r.get("mode", "fwd")) for r in results if "ms" in r}
    results = [r for r in results if (r["peer"], r["key"], r.get("mode", "fwd")) in done]
    only = dict(a.peer_points)
    for peer, points in only.items():  # a --peer-points that selects nothing is most likely a slip
        if peer not in peers:
            print(f"python -m m2ops.bench: --peer-points names {peer}, which is not among the peers run: ignored",
                  file=sys.stderr)
        elif not points & {(s.seqlen, s.dstate) for s in shapes}:
            print(f"python -m m2ops.bench: --peer-points gives {peer} no point of the grid (--seqlens x --dstates): "
                  f"it does not run", file=sys.stderr)

    def wanted(p, s):
        return (p, s.key, mode) not in done and (p not in only or (s.seqlen, s.dstate) in only[p])

    rows = collections.deque((s, todo) for s in shapes for todo in [[p for p in peers if wanted(p, s)]] if todo)
    progress = _Progress(results, path, sum(len(todo) for _, todo in rows))
    lock = threading.Lock()
    gpus = a.gpus
    if len(gpus) <= 1:
        _serve(rows, lock, a, mode, progress, gpus[0] if gpus else None, cannot)
    else:
        threads = [threading.Thread(target=_serve, args=(rows, lock, a, mode, progress, g, cannot))
                   for g in gpus]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    progress.close()
    results = [r for r in results if r.get("mode", "fwd") == mode]  # the table and plot of this mode
    order = [p for p in PEERS if p in {r["peer"] for r in results}]
    table = f"{mode}, ms\n\n" + markdown(results, order)
    profiles = kernels_markdown(results, order)
    if profiles:
        table += "\nper kernel (--kernels)\n\n" + profiles
    suffix = "" if mode == "fwd" else "-backward"
    with open(os.path.join(a.out, f"results{suffix}.md"), "w") as f:
        f.write(table)
    try:
        plot(results, os.path.join(a.out, f"speedup{suffix}.png"))
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(table)


if __name__ == "__main__":
    main()
