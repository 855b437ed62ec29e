"""The implementations a benchmark compares, each behind the same call: fn() runs one forward pass with
final states on the shared inputs (or forward and backward). A peer that cannot run here says why
(unavailable) before any worker starts, and build raises when its import fails."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import torch
import torch.nn.functional as F

from . import peer_tuning
from .timing import graphed

_EAGER = ("m2ops", "m2ops-default", "mamba_ssm-c64", "mamba_ssm-c128", "mamba_ssm-c256", "tilegym", "tilegym-tuned")
# Every peer also as "<peer>-graph": its call captured once in a CUDA graph and the graph replayed. At short
# sequences an eager call is host-bound (the GPU waits on the Python that issues its launches), so the replays
# compare the kernels themselves, as a serving stack that captures its model would see them.
PEERS = tuple(q for p in _EAGER for q in (p, p + "-graph"))


def eager_name(peer: str) -> str:
    """The peer without its "-graph" suffix: what it calls."""
    return peer[:-len("-graph")] if peer.endswith("-graph") else peer


def unavailable(peer: str, device: str) -> str | None:
    """Why peer cannot run on device (cpu or cuda[:N]) on this machine, or None when it can. Checked without
    importing the peer (find_spec only locates its package): mamba_ssm pulls in Triton, and the bench's main
    process must not load peers' kernels or touch a GPU its workers use."""
    why = []
    module = {"mamba_ssm": "mamba_ssm", "tilegym": "tilegym"}.get(eager_name(peer).split("-")[0])
    if module is not None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            why.append(f"{module} is not installed")
    # m2ops runs eagerly anywhere; the others' kernels, and every CUDA graph, need a CUDA device
    if torch.device(device).type != "cuda" and (module is not None or peer.endswith("-graph")):
        why.append(f"needs a CUDA device, and this run's device is {device}")
    return "; ".join(why) or None


def make_inputs(shape, device, seed=0):
    """x, B, C in the shape's dtype; dt (already positive: every peer takes it without softplus), A, D and
    the initial state in float32, as docs/benchmarks.md describes. Drawn on the device itself, from a generator
    seeded there: every peer gets the same values, and a 256K-token point takes milliseconds instead of the
    8-20 s that drawing 1.3 G values on the host took."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    b, T, h, p, G, n = shape.batch, shape.seqlen, shape.nheads, shape.headdim, shape.ngroups, shape.dstate

    def randn(*s, scale=1.0):
        return torch.randn(*s, generator=g, device=device) * scale

    return dict(x=randn(b, T, h, p).to(dtype), dt=F.softplus(randn(b, T, h) - 3.0),
                A=-torch.rand(h, generator=g, device=device).add(0.5),
                B=randn(b, T, G, n, scale=n ** -0.5).to(dtype), C=randn(b, T, G, n, scale=n ** -0.5).to(dtype),
                D=randn(h), initial_states=randn(b, h, p, n, scale=0.1))


def build(peer: str, inputs: dict, chunk_size: int, backward: bool = False):
    """Returns fn() for the peer: the forward pass with final states, or with backward=True the forward and
    the gradients of x, dt, A, B, C, D and the initial state for fixed output cotangents. Raises
    ImportError/RuntimeError when the peer cannot run."""
    x, dt, A, B, C, D, init = (inputs[k] for k in GRAD_INPUTS)
    forward = _forward(eager_name(peer), inputs, chunk_size)
    if not backward:
        fn = forward
    else:
        dout, dfinal = cotangents(inputs)
        if peer.startswith("tilegym"):  # (and its -graph twins)
            from tilegym.ops.cutile.mamba2 import mamba2_chunk_backward

            def fn():  # TileGym's backward takes the forward's inputs; its forward runs first, as in training
                forward()
                return mamba2_chunk_backward(x, A, B, C, D, dt, init, dout, dfinal, chunk_size=64)
        else:
            leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D, init)]

            def fn():
                y, final = forward()
                return torch.autograd.grad((y, final), leaves, (dout, dfinal))
    return graphed(fn) if peer.endswith("-graph") else fn


GRAD_INPUTS = ("x", "dt", "A", "B", "C", "D", "initial_states")


def cotangents(inputs: dict):
    """The fixed cotangents of y and of the final state that every peer's backward receives."""
    x, init = inputs["x"], inputs["initial_states"]
    g = torch.Generator(device=x.device).manual_seed(1)
    dout = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
    dfinal = torch.randn(init.shape, generator=g, device=init.device).to(init.dtype)
    return dout, dfinal


def _forward(peer, inputs, chunk_size):
    x, dt, A, B, C, D, init = (inputs[k] for k in GRAD_INPUTS)
    if peer in ("m2ops", "m2ops-default"):
        if peer == "m2ops-default":
            # The configuration chosen without search: no tuning, and an empty cache of its own so that no
            # stored winner is read either (each peer has its own worker process, so this stays in it).
            os.environ["M2OPS_AUTOTUNE"] = "0"
            os.environ["M2OPS_TUNING_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="m2ops-default-"), "none.json")
        from m2ops import mamba_chunk_scan_combined
        return lambda: mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, initial_states=init,
                                                 return_final_states=True)
    if peer.startswith("mamba_ssm-c"):
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as ms_scan
        chunk = int(peer.split("-c")[1])
        return lambda: ms_scan(x, dt, A, B, C, chunk, D=D, initial_states=init, return_final_states=True)
    if peer in ("tilegym", "tilegym-tuned"):
        # TileGym's own switch, read when a shape is first launched: untuned takes its first config.
        os.environ["TILEGYM_DISABLE_AUTOTUNE"] = "0" if peer == "tilegym-tuned" else "1"
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_forward
        if peer == "tilegym-tuned" and os.environ.get(peer_tuning.ENV):
            peer_tuning.keep_tilegym_searches(os.environ[peer_tuning.ENV])
        return lambda: mamba2_chunk_forward(x, A, B, C, D, dt, init, chunk_size=64)
    raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")


def m2ops_choice(inputs: dict, chunk_size: int) -> dict:
    """What an m2ops peer ran this point's forward with, read after its calls: chunk_scan's configuration (the
    tuning cache's entry for this shape, else "default") and whether its eager calls took a plan (planned.CALL_PLANS
    holds one under the key of _forward's call; a worker serves several points, so other points' plans are there
    too)."""
    from m2ops.kernels import autotune, planned, scan
    from m2ops.ops import dispatch, eager
    x, dt, A, B, C, D, init = (inputs[k] for k in GRAD_INPUTS)
    chunk = dispatch.kernel_chunk_size(chunk_size, x.shape[1], x.device, (x, dt, B, C))  # what the kernels ran at
    entry = autotune.stored("chunk_scan", scan.chunk_scan_shape_key(x, chunk, B, None, D, None), x.device.index or 0)
    found = None if entry is None else entry["config"]
    # _forward's call with mamba_chunk_scan_combined's defaults spelled out (first: the key whether or not any
    # plan is kept yet)
    call = eager.call_key(x, dt, A, B, C, chunk_size, D, None, None, init, None, None, False, (0.0, float("inf")),
                          True, False, first=True)
    return {"m2ops_config": found if found is not None else "default",
            "m2ops_planned": call is not None and call in planned.CALL_PLANS}
