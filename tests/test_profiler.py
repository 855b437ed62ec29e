"""torch.profiler shows each custom op by name."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import Dims, make_inputs, run_scan

# The public function runs chunk_cumsum then chunk_scan; with return_varlen_states, fwd_pass_state and
# compute_out instead of chunk_scan (the per-chunk states give the per-sequence ones).
FORWARD = ("m2ops::chunk_cumsum", "m2ops::chunk_scan")
FORWARD_VARLEN = ("m2ops::chunk_cumsum", "m2ops::fwd_pass_state", "m2ops::compute_out")
BACKWARD = ("m2ops::chunk_cumsum_bwd", "m2ops::state_passing_bwd", "m2ops::chunk_state_bwd",
            "m2ops::compute_out_bwd")


def event_names(prof):
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("varlen", [False, True])
def test_forward_events(varlen):
    inputs = make_inputs(Dims(1, 40, 2, 4, 1, 8), dtype=torch.float32, D="h", cu_seqlens=varlen)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_scan(inputs, 16, return_final_states=True, return_varlen_states=varlen)
    names = event_names(prof)
    for name in FORWARD_VARLEN if varlen else FORWARD:
        assert name in names, (name, sorted(n for n in names if "m2ops" in n))
    assert not any(name in names for name in BACKWARD)


def test_backward_events():
    inputs = make_inputs(Dims(2, 40, 2, 4, 1, 8), dtype=torch.float32, D="hp", z=True, dt_bias=True,
                         initial_states=True, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = run_scan(inputs, 16, dt_softplus=True)
        y.sum().backward()
    names = event_names(prof)
    for name in FORWARD + BACKWARD:
        assert name in names, (name, sorted(n for n in names if "m2ops" in n))


def test_each_forward_op_called_once():
    inputs = make_inputs(Dims(1, 70, 2, 4, 1, 8), dtype=torch.float32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_scan(inputs, 16)
    counts = {name: sum(e.name == name for e in prof.events()) for name in FORWARD}
    assert all(c == 1 for c in counts.values()), counts


def test_profile_cli_table_names_the_ops(capsys):
    """python -m m2ops.bench.profile (docs/profiling.md) on the CPU: the layer's forward and backward, with the
    m2ops ops in the table."""
    from m2ops.bench.profile import main
    main(["--d-model", "64", "--d-state", "16", "--seqlen", "64", "--dtype", "float32", "--backward",
          "--rows", "60", "--device", "cpu"])
    out = capsys.readouterr().out
    for name in ("m2ops::chunk_cumsum", "m2ops::chunk_scan", "m2ops::compute_out_bwd"):
        assert name in out, name
