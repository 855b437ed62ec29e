"""Chunked prefill with a start state per sequence: the package's entering and final states' corrections
(m2ops/sequence_states.py) against cheaper formulations of the same sums, timed on one set of inputs:

    python measure/serve_variants.py [bench.serve's prefill options, e.g. --sequences 64 --tokens 16384] [--json OUT]

The inputs and the call are m2ops.bench.serve's ("m2ops": mamba_chunk_scan_combined_varlen with initial_states,
out=, meta). Variants, each patched into m2ops.sequence_states for its timing (harness's rebinding):
  package         as shipped (the output term is m2ops::start_state_out, a kernel);
  fused_states    the entering and final states' corrections as one addcmul each.
Each variant's y and states are compared with the package's (rel_err); eager and CUDA-graph times are
m2ops.bench.timing's (median of --runs).
"""

from __future__ import annotations

import sys

import harness  # first of the local imports: it puts the repository on sys.path
import torch
from gpu_cases import rel_err

from m2ops import sequence_states as ss
from m2ops.bench.serve import prefill_calls, timed


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
    "fused_states": {"add_entering": entering_fused, "add_final": final_fused},
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
