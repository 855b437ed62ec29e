"""torch.library custom ops of the m2ops namespace: schemas, fake implementations, autograd.

Forward ops (one per kernel of the design): chunk_cumsum, fwd_pass_state, compute_out; each has a backward
op (<name>_bwd) that its registered autograd calls. chunk_scan: fwd_pass_state and compute_out in one op (y
and the final state only; fused kernels on CUDA; backward through compute_out_bwd and fwd_pass_state_bwd's two
stages, state_passing_bwd and chunk_state_bwd). Decoding:
state_update (one token, functional, with a backward op) and state_update_inplace (one token into a
state cache, in place). The layer's gated RMSNorm: rms_norm_gated, with rms_norm_gated_bwd. The layer's causal
convolution: causal_conv1d (with causal_conv1d_bwd) and causal_conv1d_update (one token, cache in place).
The layer from in_proj's output to out_proj's output, recomputing in its backward: mixer, with mixer_bwd.
Packed sequences' own start states at their first chunk's tokens: start_state_out, with start_state_out_bwd.
"""

from .chunk_cumsum import chunk_cumsum, chunk_cumsum_bwd
from .chunk_scan import chunk_scan
from .compute_out import compute_out, compute_out_bwd
from .conv1d import causal_conv1d, causal_conv1d_bwd, causal_conv1d_update
from .fwd_pass_state import chunk_state_bwd, fwd_pass_state, fwd_pass_state_bwd, state_passing_bwd
from .gated_norm import rms_norm_gated, rms_norm_gated_bwd
from .mixer import mixer, mixer_bwd
from .start_state_out import start_state_out, start_state_out_bwd
from .state_update import state_update, state_update_bwd
from .state_update_inplace import state_update_inplace

__all__ = ["chunk_cumsum", "chunk_cumsum_bwd", "fwd_pass_state", "fwd_pass_state_bwd", "state_passing_bwd",
           "chunk_state_bwd", "compute_out", "compute_out_bwd", "chunk_scan", "state_update", "state_update_bwd",
           "state_update_inplace", "rms_norm_gated", "rms_norm_gated_bwd", "causal_conv1d", "causal_conv1d_bwd",
           "causal_conv1d_update", "mixer", "mixer_bwd", "start_state_out", "start_state_out_bwd"]
