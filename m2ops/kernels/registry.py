"""Every cuTile kernel of m2ops by name: the one table the launchers (which build hinted variants of these
objects), the specialisation list (specs.py) and the tests read.

PDL: the kernels launched with programmatic dependent launch (config.current().pdl): the forward kernels, each of which
begins with common.dependent_launch_prologue (tests/test_dependent_launch.py checks both directions). The backward
and decode kernels are launched the ordinary way.
"""

from __future__ import annotations

from .chunk_cb import chunk_cb_kernel
from .chunk_cumsum import chunk_cumsum_kernel
from .chunk_cumsum_bwd import chunk_cumsum_bwd_kernel
from .chunk_state import chunk_state_cumsum_cb_kernel, chunk_state_kernel
from .compute_out import compute_out_kernel
from .compute_out_bwd import (out_bwd_dcbw_kernel, out_bwd_dcdb_kernel, out_bwd_dstates_kernel, out_bwd_dx_kernel,
                              out_bwd_sums_kernel)
from .compute_out_carry import compute_out_carry_kernel
from .conv1d import causal_conv1d_kernel
from .conv1d_bwd import causal_conv1d_bwd_kernel
from .conv1d_update import causal_conv1d_update_kernel
from .gated_norm import gated_norm_kernel
from .gated_norm_bwd import gated_norm_bwd_kernel
from .gated_norm_wide import gated_norm_wide_kernel
from .gated_norm_wide_bwd import gated_norm_wide_bwd_kernel, gated_norm_wide_rows_kernel
from .segments import segment_out_kernel, segment_state_kernel
from .state_pass_bwd import (chunk_state_bwd_b_kernel, chunk_state_bwd_w_kernel, chunk_state_bwd_x_kernel,
                             state_carry_grad_kernel, state_passing_bwd_kernel)
from .start_states import start_state_out_kernel
from .state_passing import state_passing_kernel
from .state_update import state_update_kernel
from .state_update_inplace import state_update_inplace_kernel
from .varlen_states import varlen_states_kernel

# name -> (kernel, launched with PDL)
_TABLE = {
    "chunk_cumsum": (chunk_cumsum_kernel, True),
    "chunk_state": (chunk_state_kernel, True),
    "chunk_state_cumsum_cb": (chunk_state_cumsum_cb_kernel, True),
    "state_passing": (state_passing_kernel, True),
    "varlen_states": (varlen_states_kernel, True),
    "start_state_out": (start_state_out_kernel, False),
    "chunk_cb": (chunk_cb_kernel, True),
    "compute_out": (compute_out_kernel, True),
    "compute_out_carry": (compute_out_carry_kernel, True),
    "segment_state": (segment_state_kernel, True),
    "segment_out": (segment_out_kernel, True),
    "state_update": (state_update_kernel, False),
    "state_update_inplace": (state_update_inplace_kernel, False),
    # Backward kernels (backward.py) take the chunk size at run time: their hints are keyed by the token block
    # the chunk size implies (common.sub_block) in place of the chunk size.
    "chunk_cumsum_bwd": (chunk_cumsum_bwd_kernel, False),
    "state_passing_bwd": (state_passing_bwd_kernel, False),
    "state_carry_grad": (state_carry_grad_kernel, False),
    "chunk_state_bwd_x": (chunk_state_bwd_x_kernel, False),
    "chunk_state_bwd_b": (chunk_state_bwd_b_kernel, False),
    "chunk_state_bwd_w": (chunk_state_bwd_w_kernel, False),
    "out_bwd_dx": (out_bwd_dx_kernel, False),
    "out_bwd_dcbw": (out_bwd_dcbw_kernel, False),
    "out_bwd_dcdb": (out_bwd_dcdb_kernel, False),
    "out_bwd_dstates": (out_bwd_dstates_kernel, False),
    "out_bwd_sums": (out_bwd_sums_kernel, False),
    # The layer's gated RMSNorm (norm.py), forward and backward.
    "gated_norm": (gated_norm_kernel, False),
    "gated_norm_wide": (gated_norm_wide_kernel, False),
    "gated_norm_wide_rows": (gated_norm_wide_rows_kernel, False),
    "gated_norm_wide_bwd": (gated_norm_wide_bwd_kernel, False),
    "gated_norm_bwd": (gated_norm_bwd_kernel, False),
    # The layer's causal convolution (conv.py): forward, backward, decode update.
    "causal_conv1d": (causal_conv1d_kernel, False),
    "causal_conv1d_bwd": (causal_conv1d_bwd_kernel, False),
    "causal_conv1d_update": (causal_conv1d_update_kernel, False),
}

KERNELS = {name: kernel for name, (kernel, _) in _TABLE.items()}
# The Python function names of the PDL kernels: a launch recognises its kernel (or a hinted or 32-bit-indexed
# variant of it, which keeps the function) by them.
PDL_FUNCTIONS = frozenset(kernel._pyfunc.__name__ for kernel, pdl in _TABLE.values() if pdl)
