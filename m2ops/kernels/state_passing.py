"""state_passing kernel: the state entering every chunk and the final state, from the chunks' local states
(second half of the fwd_pass_state op, after chunk_state.py).

One program per (block of BLK elements of one head's flattened (headdim x dstate) state, head, batch row)
walks the chunks in order:

    local_c  = states[c]                  (written by chunk_state)
    states[c] = S_c                       the state entering chunk c, in place
    S_{c+1}  = carry_c * S_c + local_c,   carry_c = exp(cs_last_c)

carry_c is zeroed when the chunk's last token belongs to another sequence than the token before the chunk
(sequence 0 owns initial_states), exactly like the reference. The final S is stored at the end.

Why: the recurrence is elementwise, so any block of the state can run alone; blocks of BLK elements give
B*H*P*N/BLK programs (640 at B=1, H=80, P=64, N=128, BLK=1024) where the old kernel had 160, and the only
dependent operation per chunk is one multiply-add. The reads of local_c, cs_last and seq_idx do not depend
on the recurrence: they are issued one chunk ahead and carried through the loop as loaded (bfloat16 local
states are widened, and cs_last exponentiated, only in the step that uses them), so each program keeps a
load in flight while it stores and updates.

Why raw: widening or exponentiating a value in the step that loads it makes that step wait for the load. In
the sm_90 build of the old form (inputs converted where loaded) every step waited for its own load, and with
bfloat16 local states the walk ran at 2.4-2.7 TB/s. Loads are unchecked (CHK False) where BLK divides the
state: a zero-padded load is a branch around the load and a copy of its registers, and the copy waits too.
Measured on an H200 (docs/history.md, v25), state_passing ms, old form -> this one, both with
512-element blocks (specialise.forward_state_block): 0.067 -> 0.051 at T=16K N=128, 0.242 -> 0.183 at T=64K N=128.

The states buffer is (b, c, h, P*N) here: a view of the contiguous (b, c, h, P, N) buffer the launcher
allocates. With SEP the entering states go to a separate `entering` array instead (e.g. in bfloat16 for
compute_out; bfloat16 activations, specialise.entering_dtype_names), never aliasing `states`: a separate constant rather than
one array passed twice, because the compiler may assume distinct parameters do not alias. A partial last
block (CHK) is zero-padded on load and clipped on store. The recurrence is float32, and the chunk size is a
run-time argument (it only addresses cs_last and seq_idx), so the specialisations are (BLK, HAS_SEQ, CHK) and
the dtypes of the local and entering states.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, Big, ConstBool, ConstInt, dependent_launch_prologue, exp2

_ZERO = ct.PaddingMode.ZERO


def _chunk_inputs(states, dA_cumsum, seq_idx, b, h, c, blk, seqlen, L, BLK, HAS_SEQ, LAT):
    """Chunk c's state block widened to float32 and its carry exp(cs_last) (0.0 where the entering state does not
    survive the chunk: _raw_carry), both formed where loaded. The backward's walk with gcarry
    (state_pass_bwd.py) reads the entering states this way; the forward walk takes _raw_chunk_inputs."""
    local = state_block(states, b, c, h, blk, BLK, True, LAT).astype(ct.float32)
    return local, exp2(_raw_carry(dA_cumsum, seq_idx, b, h, c, seqlen, L, HAS_SEQ) * LOG2E)


def _raw_chunk_inputs(states, dA_cumsum, seq_idx, b, h, c, blk, seqlen, L, BLK, HAS_SEQ, LAT, CHK):
    """Chunk c's local state block as stored and its _raw_carry, both as loaded: the walk widens and
    exponentiates them in the step that uses them (see the module's docstring)."""
    return (state_block(states, b, c, h, blk, BLK, CHK, LAT),
            _raw_carry(dA_cumsum, seq_idx, b, h, c, seqlen, L, HAS_SEQ))


def state_block(array, b, c, h, blk, BLK, CHK, LAT=None):
    """Block blk of chunk c's flattened state in array (b, c, h, P*N), as stored: zero-padded where CHK (the
    last block of a head's state is partial), else unchecked."""
    if CHK:
        t = ct.load(array, (b, c, h, blk), shape=(1, 1, 1, BLK), padding_mode=_ZERO, latency=LAT)
    else:
        t = ct.load(array, (b, c, h, blk), shape=(1, 1, 1, BLK), check_bounds=False, latency=LAT)
    return t.reshape((BLK,))


def _raw_carry(dA_cumsum, seq_idx, b, h, c, seqlen, L, HAS_SEQ):
    """cs at chunk c's last token, whose exp is the chunk's carry; -inf where the entering state does not
    survive the chunk (its last token is of another sequence than the token before the chunk; sequence 0 owns
    initial_states), so that exp2 gives the 0.0 carry."""
    cs_last = ct.load(dA_cumsum, (b, h, c, L - 1), shape=())
    if HAS_SEQ:
        start = c * L
        seq_last = ct.load(seq_idx, (b, ct.minimum(start + L - 1, seqlen - 1)), shape=())
        seq_prev = ct.load(seq_idx, (b, ct.maximum(start - 1, 0)), shape=())
        seq_prev = ct.where(c == 0, 0, seq_prev)
        cs_last = ct.where(seq_last == seq_prev, cs_last, -float("inf"))
    return cs_last


@ct.kernel
def state_passing_kernel(states: Big, dA_cumsum: Big, seq_idx: Big, initial_states: Big, final_states: Big,
                         entering: Big,
                         seqlen: int, nchunks: int, n_blocks: int, has_init: int, L: int,
                         BLK: ConstInt, HAS_SEQ: ConstBool, LAT: ConstInt, SEP: ConstBool, CHK: ConstBool):
    dependent_launch_prologue()
    pid = ct.bid(0)
    b = ct.bid(1)
    blk = pid % n_blocks
    h = pid // n_blocks

    s = ct.zeros((BLK,), dtype=ct.float32)
    if has_init != 0:
        s = ct.load(initial_states, (b, h, blk), shape=(1, 1, BLK), padding_mode=_ZERO).reshape((BLK,))

    last = nchunks - 1
    local, cs_last = _raw_chunk_inputs(states, dA_cumsum, seq_idx, b, h, 0, blk, seqlen, L, BLK, HAS_SEQ, LAT, CHK)
    for c in range(nchunks):
        # Next chunk's inputs first (the last iteration re-reads chunk c; the value is unused). Chunk c + 1's
        # slot is only written in the next iteration, after this read.
        local_n, cs_last_n = _raw_chunk_inputs(states, dA_cumsum, seq_idx, b, h, ct.minimum(c + 1, last), blk,
                                               seqlen, L, BLK, HAS_SEQ, LAT, CHK)
        if SEP:  # entering states to their own array (of its dtype), local states left as they are
            ct.store(entering, (b, c, h, blk), s.astype(entering.dtype).reshape((1, 1, 1, BLK)))
        else:
            ct.store(states, (b, c, h, blk), s.reshape((1, 1, 1, BLK)))
        # exp2(-inf) = 0: the carry of a chunk whose entering state does not survive it
        s = s * exp2(cs_last * LOG2E) + local.astype(ct.float32)
        local = local_n
        cs_last = cs_last_n

    ct.store(final_states, (b, h, blk), s.reshape((1, 1, BLK)))
