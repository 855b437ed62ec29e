"""The knobs that change what the launchers launch, in one object: `current()`, part of the key of every plan
the launchers keep, so that a changed knob gives new plans rather than stale ones.

Three of them are user switches read from the environment at import (M2OPS_PDL, M2OPS_INDEX32 and the
backward's M2OPS_BWD_SEPARATE_CARRY; README); the rest force one of the launchers' alternatives where the rules would
choose by shape, so that tests (and measurements) can reach every kernel at small sizes:

    with config.override(out_carry=False):   # compute_out's column walk wherever it can run
        ...

The rules' thresholds (measured on an H200 or H100; the numbers are in the comments beside them) are constants
of the modules that apply them, not knobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

from .. import envvars


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity, cheap in a plan's key
class LaunchConfig:
    # Programmatic dependent launch of the forward kernels on compute capability 9.0 and later (M2OPS_PDL=0: off).
    pdl: bool = True
    # The 32-bit-indexed twins (TMA loads) wherever every array fits int32 offsets (M2OPS_INDEX32=0: off).
    index32: bool = True
    # The backward's carry gradient apart from the walk (True), in it (False), or by the walk's block (None;
    # M2OPS_BWD_SEPARATE_CARRY).
    separate_carry_grad: Optional[bool] = None
    # The forward's output kernel: compute_out_carry where it can run (True), compute_out's column walk (False),
    # or by dstate and length (None).
    out_carry: Optional[bool] = None
    # The output kernels take the chunks last first (run-time argument).
    out_reverse: bool = True
    # chunk_scan's fused segment kernels where they can run (True), never (False), or by the tuned or default
    # configuration (None); segment_count: that many segments instead of the count sized to the GPU.
    segments: Optional[bool] = None
    segment_count: Optional[int] = None
    # state_passing's block of state elements in the forward and the backward walk (None: each one's rule).
    state_block: Optional[int] = None
    # chunk_state's heads per program where it divides a group's heads (None: the table's, per dtype, chunk
    # size and dstate).
    chunk_state_heads: Optional[int] = None
    # chunk_cumsum's and chunk_cb's work in chunk_state's launch, in the planned forward, up to this many chunks.
    fused_cumsum: bool = True
    fused_cumsum_max_chunks: int = 4
    # From this many tokens a caller's chunk of 64 or 128 runs on chunks of 256.
    super_chunk_min_seqlen: int = 4096

    def replace(self, **changes) -> "LaunchConfig":
        return dataclasses.replace(self, **changes)


_CURRENT = [LaunchConfig(pdl=envvars.switch("M2OPS_PDL", True), index32=envvars.switch("M2OPS_INDEX32", True),
                         separate_carry_grad=envvars.switch("M2OPS_BWD_SEPARATE_CARRY", None))]


def current() -> LaunchConfig:
    return _CURRENT[0]


def set_current(cfg: LaunchConfig) -> None:
    if not isinstance(cfg, LaunchConfig):
        raise TypeError(f"cfg must be a LaunchConfig, got {type(cfg).__name__}")
    _CURRENT[0] = cfg


@contextlib.contextmanager
def override(**changes):
    """current() with changes for the duration of the block (not thread-local: for tests and measurements)."""
    before = _CURRENT[0]
    set_current(before.replace(**changes))
    try:
        yield _CURRENT[0]
    finally:
        _CURRENT[0] = before
