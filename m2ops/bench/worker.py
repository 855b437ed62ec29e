"""One benchmark point in its own process (a peer's illegal memory access poisons its process):
python -m m2ops.bench.worker '<json job>' prints one line 'RESULT <json>'."""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from .peers import build, make_inputs
from .shapes import Shape
from .timing import median_ms


def run(job: dict) -> dict:
    shape = Shape(**job["shape"])
    device = torch.device(job.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    inputs = make_inputs(shape, device)
    t0 = time.perf_counter()
    fn = build(job["peer"], inputs, job["chunk_size"], backward=job.get("backward", False))
    fn()  # compile / tune / capture happen here, outside the timing
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - t0
    ms = median_ms(fn, runs=job["runs"], warmup=job["warmup"], device=device)
    out = {"ms": ms, "setup_s": round(setup_s, 2), "device": _device_name(device)}
    if job.get("check") and job["peer"] == "m2ops" and not job.get("backward"):
        from .check import errors
        y, final = fn()
        out.update(errors(inputs, job["chunk_size"], y, final))
    return out


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main():
    job = json.loads(sys.argv[1])
    try:
        result = run(job)
    except Exception as e:  # recorded, never dropped
        tb = traceback.format_exc().strip().splitlines()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                  "trace": tb[-3:]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
