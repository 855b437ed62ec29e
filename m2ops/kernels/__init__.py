"""cuTile kernels of the three forward ops, behind launchers with the reference functions' signatures.

    chunk_cumsum.py    chunk_cumsum_kernel    dt preprocessing, within-chunk cumsum of dt*A
    chunk_state.py     chunk_state_kernel     each chunk's local state from zero (parallel over chunks)  } the
    state_passing.py   state_passing_kernel   chunk-entering and final states, in place (sequential  } fwd_pass_state
                                              over chunks, parallel over blocks of the state)        } op
    varlen_states.py   varlen_states_kernel   final state of each cu_seqlens sequence
    chunk_cb.py        chunk_cb_kernel        C . B^T per chunk and group (lower-triangular blocks,  } the
                                              or the diagonal ones for compute_out_carry)            } compute_out
    compute_out.py     compute_out_kernel     y, with D and z fused: one program per row block,      } op
                                              walking the chunk's earlier column blocks              }
    compute_out_carry.py compute_out_carry_kernel  the same y, one program per chunk carrying the    }
                                              state through its row blocks (dstate <= 128)           }
    segments.py        segment_state_kernel,  the chunk_scan op (fwd_pass_state + compute_out fused): segment
                       segment_out_kernel     end states, state_passing over segments, y from registers-held
                                              states, no per-chunk states in memory
    state_update.py    state_update_kernel    one decode token: new state and y (the state_update op)
    chunk_cumsum_bwd.py, state_pass_bwd.py, compute_out_bwd.py
                       the backward kernels of the three ops (the CUDA implementations of the *_bwd ops),
                       launched by launch_bwd.py
    launch.py          grids and arguments; float64 and unsupported chunk sizes run the reference
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
    from .launch import chunk_cumsum, chunk_scan, compute_out, fwd_pass_state, state_update
    from .launch_bwd import chunk_cumsum_bwd, compute_out_bwd, fwd_pass_state_bwd
    from .specs import all_specs

    __all__ = ["chunk_cumsum", "fwd_pass_state", "compute_out", "chunk_scan", "state_update",
               "chunk_cumsum_bwd", "fwd_pass_state_bwd", "compute_out_bwd", "unavailable_reason", "all_specs"]
