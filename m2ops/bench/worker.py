"""The benchmark's worker process: one per peer, serving points one after another, so that the interpreter,
the peer's imports and its compiled kernels are paid once per peer rather than once per point.

    python -m m2ops.bench.worker --serve   reads one json job per line on stdin, answers each with one line
                                           'RESULT <json>'

After a failed point the serving worker exits (a peer's illegal memory access poisons its CUDA context), and
the pool (pool.py) starts a fresh one for the next point. With the bench's --fresh every point gets a new worker.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

import torch

from . import peer_tuning
from .peers import build, cotangents, eager_name, make_inputs
from .shapes import Shape
from .timing import median_ms


def run(job: dict) -> dict:
    shape = Shape(**job["shape"])
    device = torch.device(job.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    inputs = make_inputs(shape, device)
    searches_before = peer_tuning.search_counts()
    t0 = time.perf_counter()
    fn = build(job["peer"], inputs, job["chunk_size"], backward=job.get("backward", False))
    fn()  # compile / tune / capture happen here, outside the timing
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - t0
    ms = median_ms(fn, runs=job["runs"], warmup=job["warmup"], device=device)
    out = {"ms": ms, "setup_s": round(setup_s, 2), "device": _device_name(device), "pid": os.getpid()}
    if eager_name(job["peer"]) == "tilegym-tuned":
        # how this point's searches were answered: from --peer-tuning's file, or run
        after = peer_tuning.search_counts()
        out["tilegym_searches"] = {k: after[k] - searches_before[k] for k in after}
    if job["peer"].startswith("m2ops") and device.type == "cuda" and not job.get("backward"):
        from .peers import m2ops_choice
        out.update(m2ops_choice(inputs, job["chunk_size"]))
    if job.get("kernels"):  # after the timed runs, so the profiler does not touch them
        from .kernels import kernel_times
        out["kernel_ms"] = kernel_times(fn, device)
    if job.get("check") and job["peer"] == "m2ops":
        from .check import errors, grad_errors
        if job.get("backward"):
            out.update(grad_errors(inputs, job["chunk_size"], fn(), *cotangents(inputs)))
        else:
            y, final = fn()
            out.update(errors(inputs, job["chunk_size"], y, final))
    return out


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def answer(job: dict) -> dict:
    """The result of one job, or its error (recorded, never dropped)."""
    try:
        return run(job)
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                "trace": tb[-3:]}


def _release():
    # Idle workers of the other peers share the GPU: give back this point's memory before the next.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main():
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python -m m2ops.bench.worker --serve   (started by m2ops.bench's pool)")
    for line in sys.stdin:
        if not line.strip():
            continue
        result = answer(json.loads(line))
        _release()
        print("RESULT " + json.dumps(result), flush=True)
        if "error" in result:
            return


if __name__ == "__main__":
    main()
