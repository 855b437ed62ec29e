"""Chunked prefill with a start state per sequence: the package's start-state corrections (m2ops/sequence_states.py)
against cheaper formulations of the same sums, timed on one set of inputs:

    python measure/serve_variants.py [bench.serve's prefill options, e.g. --sequences 64 --tokens 16384] [--json OUT]

The inputs and the call are m2ops.bench.serve's ("m2ops": mamba_chunk_scan_combined_varlen with initial_states,
out=, meta). Variants, each patched into m2ops.sequence_states for its timing (harness's rebinding):
  package         as shipped;
  lowp_product    the start states' products with C in C's dtype when it is 16-bit (tensor cores, float32
                  accumulation) instead of a float32 GEMM; the rest as shipped;
  no_atomics      also the sum into y without atomics when no gradient is recorded: y's rows in the windows
                  gathered, the corrections added, written back with index_copy_ (each window's rows past its
                  sequence's first chunk point at its first row and carry that row's value, so repeated indices
                  write equal values);
  fused_states    also the entering and final states' corrections as one addcmul each.
Each variant's y and states are compared with the package's (rel_err); eager and CUDA-graph times are
m2ops.bench.timing's (median of --runs).
"""

from __future__ import annotations

import sys

import harness  # first of the local imports: it puts the repository on sys.path
import torch
import torch.nn.functional as F
from gpu_cases import rel_err

from m2ops import sequence_states as ss
from m2ops.bench.serve import prefill_calls, timed


def first_chunk_lowp(y, C, z, init, Pz, index, acc, no_atomics=False):
    """ss.add_first_chunk with the product in C's dtype (16-bit C) and, with no_atomics, no index_add_."""
    if index.window.shape[0] == 0:
        return y
    g, h = C.shape[2], init.shape[1]
    win = index.window
    expo = Pz[:, win + 1] - Pz[:, index.start[1:]][:, :, None]
    decay = torch.exp(expo.masked_fill(~index.inside, float("-inf"))).permute(1, 2, 0).to(acc)  # (k, L, h)
    mm = C.dtype if C.dtype in (torch.bfloat16, torch.float16) else acc
    start_states = init[1:].to(mm).unflatten(1, (g, h // g))
    dy = torch.einsum("kjgn,kgrpn->kjgrp", C[0, win].to(mm), start_states).flatten(2, 3).float() * decay[..., None]
    if z is not None:
        dy = dy * F.silu(z[0, win].float())
    if torch.is_grad_enabled() and y.requires_grad:
        return y.index_add(1, win.flatten(), dy.flatten(0, 1).unsqueeze(0).to(y.dtype))
    if not no_atomics:
        return y.index_add_(1, win.flatten(), dy.flatten(0, 1).unsqueeze(0).to(y.dtype))
    inside = index.inside
    first = index.start[1:]
    vals = (y[0, win].float() + dy)  # (k, L, h, p)
    vals = torch.where(inside[..., None, None], vals, vals[:, :1]).to(y.dtype)
    idx = torch.where(inside, win, first[:, None])
    y[0].index_copy_(0, idx.flatten(), vals.flatten(0, 1))
    return y


def entering_fused(states, init, Pz, index):
    L = index.chunk_size
    c = states.shape[1]
    at = torch.arange(c, device=Pz.device) * L
    decay = torch.exp(Pz[:, at] - Pz[:, index.start[index.owner]]).t().to(states.dtype)  # (c, h)
    return torch.addcmul(states, decay[None, :, :, None, None], init.to(states.dtype)[index.owner][None])


def final_fused(varlen, init, Pz, index):
    decay = torch.exp(Pz[:, index.end] - Pz[:, index.start]).t().to(varlen.dtype)
    return torch.addcmul(varlen, decay[..., None, None], init.to(varlen.dtype))


VARIANTS = {
    "package": {},
    "lowp_product": {"add_first_chunk": first_chunk_lowp},
    "no_atomics": {"add_first_chunk": lambda *a: first_chunk_lowp(*a, no_atomics=True)},
    "fused_states": {"add_first_chunk": lambda *a: first_chunk_lowp(*a, no_atomics=True),
                     "add_entering": entering_fused, "add_final": final_fused},
}


def main():
    args, json_path = harness.serve_prefill_args(sys.argv[1:])
    lens, calls = prefill_calls(args, None)
    fn = calls["m2ops"]
    rows, ref = [], None
    with torch.no_grad():
        for name, patch in VARIANTS.items():
            with harness._rebound({k: (getattr(ss, k), v) for k, v in patch.items()}):
                got = [t.float().clone() for t in fn()]
                row = {"variant": name, "eager": timed(fn, args, False)}
                if args.device.type == "cuda":
                    row["graph"] = timed(fn, args, True)
            ref = ref or got
            row["y_rel_err"], row["states_rel_err"] = rel_err(got[0], ref[0]), rel_err(got[1], ref[1])
            rows.append(row)
            print(f"{name:14s} eager {row['eager']['median_ms']:.3f} ms  graph "
                  f"{row.get('graph', {}).get('median_ms', float('nan')):.3f} ms  y err {row['y_rel_err']:.1e}  "
                  f"states err {row['states_rel_err']:.1e}", flush=True)
    harness.write_json(json_path, rows, lengths=lens)


if __name__ == "__main__":
    main()
