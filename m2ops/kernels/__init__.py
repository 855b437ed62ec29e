"""cuTile kernels of the ops, and their launchers (with the reference functions' signatures).

Kernels (one file each, beside nothing but their device helpers):
    chunk_cumsum.py    chunk_cumsum_kernel    dt preprocessing, within-chunk cumsum of dt*A
    chunk_state.py     chunk_state_kernel     each chunk's local state from zero (parallel over chunks)  } the
    state_passing.py   state_passing_kernel   chunk-entering and final states, in place (sequential  } fwd_pass_state
                                              over chunks, parallel over blocks of the state)        } op
    varlen_states.py   varlen_states_kernel   final state of each cu_seqlens sequence
    start_states.py    start_state_out_kernel packed sequences' own start states at their first chunk's tokens
    chunk_cb.py        chunk_cb_kernel        C . B^T per chunk and group                            } the
    compute_out.py     compute_out_kernel     y, with D and z fused: one program per row block       } compute_out
    compute_out_carry.py compute_out_carry_kernel  the same y, one program per chunk carrying the    } op
                                              state through its row blocks (dstate <= 128)           }
    segments.py        segment_state_kernel,  chunk_scan's fused path: segment end states, state_passing over
                       segment_out_kernel     segments, y from register-held states (a tuning candidate)
    state_update.py    state_update_kernel    one decode token
    state_update_inplace.py  state_update_inplace_kernel  one decode token into a state cache, in place
    chunk_cumsum_bwd.py, state_pass_bwd.py, compute_out_bwd.py   the backward kernels of the three ops
    gated_norm.py      gated_norm_kernel      the layer's gated RMSNorm: y and rstd per (row block, group)
    gated_norm_wide.py gated_norm_wide_kernel the same for groups wider than one tile, in column tiles
    gated_norm_bwd.py  gated_norm_bwd_kernel  its backward: dx, dz, partial weight and bias sums
    gated_norm_wide_bwd.py  gated_norm_wide_rows_kernel, gated_norm_wide_bwd_kernel  the same for wide groups
    conv1d.py, conv1d_bwd.py, conv1d_update.py   causal_conv1d_kernel, causal_conv1d_bwd_kernel,
                       causal_conv1d_update_kernel: the layer's causal depthwise convolution (+ SiLU),
                       forward, backward and one decode token (cache updated in place)

Launch side, one concern a module:
    registry.py        every kernel by name, and which take programmatic dependent launch
    config.py          the knobs that change what is launched (one object, part of every plan's key)
    specialise.py      each kernel's constants and hints, and the rules that pick them from sizes and dtypes
    runtime.py         argument conversion, the launch itself (32-bit twins, PDL), plans kept per signature
    forward.py         launchers of chunk_cumsum, fwd_pass_state and compute_out
    scan.py            the chunk_scan launcher and its tuning (autotune.py keeps the results)
    planned.py         the eager forward planned once per signature (what a repeated call runs)
    backward.py        launchers of the three ops' backward kernels
    decode.py          the state_update and state_update_inplace launchers
    norm.py            the gated RMSNorm's launchers (forward and backward), tiles and hints
    conv.py            the causal convolution's launchers (forward, backward, update) and tiles
    index_width.py     32-bit-indexed twins of the kernels (TMA loads) where every array fits int32 offsets
    specs.py           every specialisation the launchers can launch, with signatures for AOT compiles
    support.py         unavailable_reason(device_index)

Without cuda.tile the package still imports (autotune.py needs no cuTile) but defines no launchers;
unavailable_reason then says cuda.tile is missing, and m2ops.ops.dispatch runs the reference.
"""

from .support import unavailable_reason

try:
    import cuda.tile  # noqa: F401
except ImportError:
    __all__ = ["unavailable_reason"]
else:
    # Imported after the kernel modules of the same names, so these names are the launchers.
    from .backward import chunk_cumsum_bwd, chunk_state_bwd, compute_out_bwd, fwd_pass_state_bwd, state_passing_bwd
    from .conv import causal_conv1d, causal_conv1d_bwd, causal_conv1d_update
    from .decode import state_update, state_update_inplace
    from .forward import chunk_cumsum, compute_out, fwd_pass_state, start_state_out
    from .norm import rms_norm_gated, rms_norm_gated_bwd
    from .scan import chunk_scan
    from .specs import all_specs

    __all__ = ["chunk_cumsum", "fwd_pass_state", "compute_out", "start_state_out", "chunk_scan", "state_update",
               "state_update_inplace", "chunk_cumsum_bwd", "fwd_pass_state_bwd", "state_passing_bwd",
               "chunk_state_bwd", "compute_out_bwd",
               "rms_norm_gated", "rms_norm_gated_bwd", "causal_conv1d", "causal_conv1d_bwd", "causal_conv1d_update",
               "unavailable_reason", "all_specs"]
