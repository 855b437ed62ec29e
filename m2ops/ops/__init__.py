"""torch.library custom ops of the m2ops namespace: schemas, fake implementations, autograd.

Forward ops (one per kernel of the design): chunk_cumsum, fwd_pass_state, compute_out; each has a backward
op (<name>_bwd) that its registered autograd calls. chunk_scan: fwd_pass_state and compute_out in one op (y
and the final state only; fused kernels on CUDA; backward through the two ops' backward ops). Decoding:
state_update (one token, functional).
"""

from .chunk_cumsum import chunk_cumsum, chunk_cumsum_bwd
from .chunk_scan import chunk_scan
from .compute_out import compute_out, compute_out_bwd
from .fwd_pass_state import fwd_pass_state, fwd_pass_state_bwd
from .state_update import state_update, state_update_bwd

__all__ = ["chunk_cumsum", "chunk_cumsum_bwd", "fwd_pass_state", "fwd_pass_state_bwd", "compute_out",
           "compute_out_bwd", "chunk_scan", "state_update", "state_update_bwd"]
