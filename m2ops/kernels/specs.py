"""Every specialisation of every kernel that the launchers can launch, and a KernelSignature for each, so
that they can be compiled ahead of time without a GPU (tests/test_kernels_compile.py builds all of them for
sm_90, and covering sets of them for other architectures).

A specialisation is a kernel plus its compile-time constants and its array dtypes. The launchers convert
inputs so that only these combinations occur: all activations in one dtype (float16, bfloat16 or float32),
the chunk intermediates, states, A, dt_bias, D and initial_states in float32, seq_idx and cu_seqlens in
int32. Flags that only select a branch outside the inner loops (dt_bias, softplus, initial_states, D, z) are
run-time arguments and do not multiply the specialisations; seq_idx, which masks inside the inner loops,
is a constant (HAS_SEQ). state_passing and chunk_cb are listed once per block size / chunk size: the former
reads only float32 (its dtype is "float32" whatever the activations), the latter once per input dtype.
Kernels the launchers compile with ct.kernel hints (specialise.kernel_hints: occupancy) carry them in their
Spec, so the compile test builds exactly the objects the launchers launch. state_update (decode) is listed
per activation dtype, dt dtype and state dtype (each the activations' dtype or float32) and dstate tile, the
first two dtypes in Spec.dtypes; state_update_inplace (decode into a cache) likewise. The gated RMSNorm's
kernels are listed per activation dtype and group tile, the forwards and the convolution's decode update also per
weight-and-bias dtype (float32 or the activations', PARAM_KERNELS).

The signatures describe contiguous inputs (last stride 1); at run time cuTile specialises further on the
actual strides and alignment, as it does for any kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

from . import backward, conv, decode, index_width, norm, specialise, start_states
from .common import CHUNK_SIZES, INPUT_DTYPES, SEGMENT_NTS, STATE_BLOCKS
from .registry import KERNELS

F32, I32 = "float32", "int32"


@dataclass(frozen=True)
class Spec:
    kernel_name: str
    dtype: str                       # dtype of the activations (of dt for chunk_cumsum)
    constants: dict = field(hash=False)
    # Run-time parameters in order: ("array", dtype, ndim) or ("int",) / ("float",).
    params: tuple = field(hash=False)
    # ct.kernel hints the launcher compiles this specialisation with (specialise.kernel_hints), as items.
    hints: tuple = ()
    # Other array dtypes that tell specialisations apart, as (role, dtype) items (state_update: dt, state).
    dtypes: tuple = ()
    # The 32-bit-indexed twin (index_width.narrow_twin) that launches take where the arrays fit.
    narrow: bool = False

    @property
    def kernel(self):
        return index_width.narrow_twin(self.wide_kernel) if self.narrow else self.wide_kernel

    @property
    def wide_kernel(self):
        """The kernel with its 64-bit-indexed arrays (the object launchers name; its twin derives from it)."""
        return specialise.hinted(self.kernel_name, self.hints) if self.hints else KERNELS[self.kernel_name]

    @property
    def name(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in (*self.dtypes, *self.constants.items(), *self.hints))
        return f"{self.kernel_name}[{self.dtype},{consts}{',index32' if self.narrow else ''}]"

    def signature(self) -> KernelSignature:
        return _signature(self.kernel, self.params, self.constants)

    def key(self) -> tuple:
        """What tells this specialisation apart, in the form launch_key gives a launch (64-bit kernels)."""
        k = self.wide_kernel
        params = iter(self.params)
        parts = []
        for name, node in zip(k._annotated_function.pysig.parameters, k._annotated_function.parameter_annotations):
            if node.constant:
                parts.append((name, self.constants[name]))
            else:
                kind = next(params)
                parts.append((name, *kind[1:]) if kind[0] == "array" else (name, kind[0]))
        return (k._pyfunc.__name__, _options(k), tuple(parts))


def launch_key(kernel, args) -> tuple:
    """The Spec.key() a launch of kernel with args (in the order of its Python signature) needs: the kernel,
    its compiler options, each array's dtype and rank, each scalar's kind, each constant's value."""
    parts = []
    ann = kernel._annotated_function
    for name, node, a in zip(ann.pysig.parameters, ann.parameter_annotations, args):
        if node.constant:
            parts.append((name, a))
        elif hasattr(a, "dtype") and hasattr(a, "dim"):
            parts.append((name, str(a.dtype).replace("torch.", ""), a.dim()))
        else:
            parts.append((name, "float" if isinstance(a, float) else "int"))
    return (kernel._pyfunc.__name__, _options(kernel), tuple(parts))


def _options(kernel) -> tuple:
    return tuple(sorted((k, v) for k, v in dataclasses.asdict(kernel._compiler_options).items() if v is not None))


def _a(dtype, ndim):
    return ("array", dtype, ndim)


# The kernels whose weight and bias come in float32 or in the activations' dtype (runtime.param_dtype).
PARAM_KERNELS = ("gated_norm", "gated_norm_wide", "causal_conv1d_update", "state_update_inplace")


def param_dtypes(dt: str) -> tuple:
    return (F32,) if dt == F32 else (F32, dt)


_INT, _FLOAT = ("int",), ("float",)


def _params(kernel_name: str, dt: str, dt_dtype: str = F32, state_dtype: str = F32, cb_dtype: str = F32,
            g_dtype: str = F32, g_local_dtype: str = F32, local_dtype: str = F32, param_dtype: str = F32) -> tuple:
    """Run-time parameters of each kernel, in the order of its Python signature (constants excluded).
    dt_dtype and state_dtype: state_update's dt and state (and new_state) arrays; state_dtype is also
    state_passing's separate entering-state output and compute_out's states; cb_dtype: chunk_cb's output and
    compute_out's C . B^T; g_dtype: compute_out_bwd's G; g_local_dtype: fwd_pass_state's backward's glocal;
    local_dtype: the local states chunk_state writes and state_passing reads; param_dtype: the weight and bias of
    PARAM_KERNELS (runtime.param_dtype)."""
    if kernel_name == "chunk_cumsum":
        return (_a(dt, 3), _a(F32, 1), _a(F32, 1), _a(F32, 4), _a(F32, 4),
                _INT, _INT, _INT, _INT, _FLOAT, _FLOAT)
    if kernel_name == "chunk_state":
        return (_a(dt, 4), _a(dt, 4), _a(F32, 4), _a(F32, 4), _a(I32, 2), _a(local_dtype, 5),
                _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "chunk_state_cumsum_cb":
        return (_a(dt, 4), _a(dt, 4), _a(dt_dtype, 3), _a(F32, 1), _a(F32, 1), _a(F32, 4), _a(F32, 4),
                _a(local_dtype, 5), _a(dt, 4), _a(cb_dtype, 5), *(_INT,) * 10, _FLOAT, _FLOAT)
    if kernel_name == "state_passing":
        return (_a(local_dtype, 4), _a(F32, 4), _a(I32, 2), _a(F32, 3), _a(F32, 3), _a(state_dtype, 4),
                _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "chunk_cb":
        return (_a(dt, 4), _a(dt, 4), _a(cb_dtype, 5), _INT)
    if kernel_name == "varlen_states":
        return (_a(dt, 4), _a(dt, 4), _a(F32, 4), _a(F32, 4), _a(F32, 5), _a(I32, 1), _a(F32, 4),
                _INT, _INT)
    if kernel_name == "start_state_out":
        return (_a(dt, 4), _a(dt, 4), _a(state_dtype, 4), _a(F32, 4), _a(I32, 1), _a(dt, 4), *(_INT,) * 6)
    if kernel_name == "compute_out":
        return (_a(dt, 4), _a(F32, 4), _a(F32, 4), _a(dt, 4), _a(cb_dtype, 5), _a(state_dtype, 5), _a(F32, 2),
                _a(dt, 4),
                _a(I32, 2), _a(dt, 4),
                _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "compute_out_carry":
        return (_a(dt, 4), _a(F32, 4), _a(F32, 4), _a(dt, 4), _a(cb_dtype, 5), _a(state_dtype, 5), _a(F32, 2),
                _a(dt, 4), _a(I32, 2), _a(dt, 4), _a(dt, 4),
                _INT, _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "segment_state":
        return (_a(dt, 4), _a(dt, 4), _a(F32, 3), _a(F32, 3), _a(I32, 2), _a(F32, 5), _a(F32, 4),
                _INT, _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "segment_out":
        return (_a(dt, 4), _a(F32, 3), _a(F32, 3), _a(dt, 4), _a(dt, 4), _a(I32, 2), _a(F32, 5), _a(F32, 2),
                _a(dt, 4), _a(dt, 4),
                _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "chunk_cumsum_bwd":
        return (_a(F32, 4), _a(F32, 4), _a(dt, 3), _a(F32, 1), _a(F32, 1), _a(dt, 3), _a(F32, 3), _a(F32, 3),
                _INT, _INT, _INT, _INT, _FLOAT, _FLOAT)
    if kernel_name == "state_passing_bwd":
        return (_a(state_dtype, 4), _a(F32, 4), _a(F32, 3), _a(F32, 4), _a(I32, 2), _a(g_local_dtype, 4), _a(F32, 4),
                _a(F32, 3), _INT, _INT, _INT, _INT)
    if kernel_name == "state_carry_grad":
        return (_a(state_dtype, 4), _a(g_local_dtype, 4), _a(F32, 4), _INT, _INT)
    if kernel_name == "chunk_state_bwd_x":
        return (_a(dt, 4), _a(dt, 4), _a(F32, 4), _a(F32, 4), _a(I32, 2), _a(g_local_dtype, 5), _a(dt, 4),
                _a(F32, 4), _INT, _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "chunk_state_bwd_b":
        return (_a(dt, 4), _a(F32, 4), _a(F32, 4), _a(I32, 2), _a(g_local_dtype, 5), _a(dt, 4),
                _INT, _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "out_bwd_sums":
        return (_a(F32, 4), _a(F32, 5), _a(F32, 4), _a(F32, 4), _a(F32, 4), _INT, _INT, _INT, _INT)
    if kernel_name == "chunk_state_bwd_w":
        return (_a(F32, 4), _a(F32, 4), _a(F32, 4), _a(F32, 3), _a(I32, 2), _a(F32, 4), _a(F32, 4),
                _INT, _INT, _INT, _INT)
    if kernel_name == "out_bwd_dx":
        return (_a(g_dtype, 4), _a(F32, 4), _a(F32, 4), _a(F32, 5), _a(I32, 2), _a(dt, 4), _a(F32, 2), _a(dt, 4),
                _a(F32, 4), _a(F32, 4), _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "out_bwd_dcbw":
        return (_a(g_dtype, 4), _a(dt, 4), _a(F32, 4), _a(F32, 4), _a(F32, 5), _a(I32, 2), _a(F32, 6), _a(F32, 4),
                _a(F32, 4), _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "out_bwd_dcdb":
        return (_a(g_dtype, 4), _a(F32, 4), _a(dt, 4), _a(dt, 4), _a(state_dtype, 5), _a(I32, 2), _a(F32, 5), _a(dt, 4),
                _a(dt, 4), _a(F32, 4), _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "out_bwd_dstates":
        return (_a(g_dtype, 4), _a(F32, 4), _a(dt, 4), _a(I32, 2), _a(F32, 5), _INT, _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "state_update":
        return (_a(state_dtype, 4), _a(dt, 3), _a(dt_dtype, 2), _a(F32, 1), _a(dt, 3), _a(dt, 3), _a(F32, 2),
                _a(dt, 3), _a(F32, 1), _a(state_dtype, 4), _a(dt, 3),
                _INT, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _FLOAT, _FLOAT)
    if kernel_name == "state_update_inplace":
        return (_a(state_dtype, 4), _a(dt, 3), _a(dt_dtype, 2), _a(param_dtype, 1), _a(dt, 3), _a(dt, 3),
                _a(F32, 2), _a(dt, 3), _a(param_dtype, 1), _a(I32, 1), _a(dt, 3), *(_INT,) * 11, _FLOAT, _FLOAT)
    if kernel_name == "gated_norm":
        return (_a(dt, 3), _a(dt, 3), _a(param_dtype, 2), _a(param_dtype, 2), _a(dt, 3), _a(F32, 2), _FLOAT, _FLOAT,
                _INT, _INT, _INT)
    if kernel_name == "gated_norm_wide":
        return (_a(dt, 3), _a(dt, 3), _a(param_dtype, 2), _a(param_dtype, 2), _a(dt, 3), _a(F32, 2), _FLOAT, _FLOAT,
                _INT, _INT, _INT)
    if kernel_name == "gated_norm_wide_rows":
        return (_a(dt, 3), _a(dt, 3), _a(dt, 3), _a(F32, 2), _a(F32, 2), _a(F32, 2), _FLOAT, _INT, _INT, _INT)
    if kernel_name == "gated_norm_wide_bwd":
        return (_a(dt, 3), _a(dt, 3), _a(dt, 3), _a(F32, 2), _a(F32, 2), _a(F32, 2), _a(F32, 2), _a(dt, 3), _a(dt, 3),
                _a(F32, 3), _a(F32, 3), _INT, _INT, _INT, _INT, _INT)
    if kernel_name == "gated_norm_bwd":
        return (_a(dt, 3), _a(dt, 3), _a(dt, 3), _a(F32, 2), _a(F32, 2), _a(F32, 2), _a(dt, 3), _a(dt, 3),
                _a(F32, 3), _a(F32, 3), _INT, _INT, _FLOAT, _INT, _INT, _INT)
    if kernel_name == "causal_conv1d":
        return (_a(dt, 3), _a(F32, 2), _a(F32, 1), _a(I32, 2), _a(F32, 3), _a(dt, 3), _a(dt, 3), *(_INT,) * 6)
    if kernel_name == "causal_conv1d_bwd":
        return (_a(dt, 3), _a(dt, 3), _a(F32, 2), _a(F32, 1), _a(I32, 2), _a(F32, 3), _a(dt, 3), _a(F32, 3),
                _a(F32, 2), _a(F32, 3), *(_INT,) * 6)
    if kernel_name == "causal_conv1d_update":  # state_dtype: conv_state's
        return (_a(dt, 2), _a(state_dtype, 3), _a(param_dtype, 2), _a(param_dtype, 1), _a(I32, 1), _a(dt, 2),
                *(_INT,) * 5)
    raise KeyError(kernel_name)


def _hints(kernel_name: str, dt: str, L: int) -> tuple:
    return tuple(sorted(specialise.kernel_hints(kernel_name, dt, L).items()))


def all_specs() -> list[Spec]:
    """The complete list, in a stable order."""
    out = []
    for dt in INPUT_DTYPES:
        for L in CHUNK_SIZES:
            out.append(Spec("chunk_cumsum", dt, specialise.chunk_cumsum_constants(L), _params("chunk_cumsum", dt)))
            # one head per program, and chunk_state_heads's choice where it is more (odd heads per group fall
            # back to one)
            # (and its two dstate tiles: specialise.chunk_state_tn)
            for hb in sorted({1, specialise.table_heads(dt, L)}):
                for has_seq in (False, True):
                    for check in (True, False):
                        for ld in specialise.local_dtype_names(dt, L):
                            for tn in (specialise.CHUNK_STATE_SMALL_TN, specialise.CHUNK_STATE_TN):
                                out.append(Spec("chunk_state", dt,
                                                specialise.chunk_state_constants(L, has_seq, check, hb, tn),
                                                _params("chunk_state", dt, local_dtype=ld),
                                                tuple(sorted(specialise.chunk_state_hints(dt, L, hb).items())),
                                                dtypes=(("local", ld),) if ld != F32 else ()))
                                if not has_seq and specialise.fused_cumsum_can_run(L, hb):
                                    # with chunk_cb's programs and chunk_cumsum's work (the planned forward,
                                    # which has no seq_idx), for dt in float32 or the activations' dtype
                                    cbd = specialise.cb_dtype_name(dt)
                                    for dtd in sorted({F32, dt}):
                                        out.append(Spec("chunk_state_cumsum_cb", dt,
                                                        specialise.fused_cumsum_constants(L, check, hb, tn),
                                                        _params("chunk_state_cumsum_cb", dt, dt_dtype=dtd,
                                                                local_dtype=ld, cb_dtype=cbd),
                                                        tuple(sorted(specialise.chunk_state_hints(dt, L, hb).items())),
                                                        dtypes=tuple((r, d) for r, d in
                                                                     (("dt", dtd), ("local", ld), ("cb", cbd))
                                                                     if d != F32)))
            out.append(Spec("varlen_states", dt, specialise.varlen_states_constants(L),
                            _params("varlen_states", dt)))
            # per-sequence start states: one build per token block, start states in float32 or the activations'
            if L <= 64:
                for sd in sorted({F32, dt}):
                    out.append(Spec("start_state_out", dt, start_states.start_state_out_constants(L),
                                    _params("start_state_out", dt, state_dtype=sd), _hints("start_state_out", dt, 0),
                                    dtypes=(("states", sd),) if sd != F32 else ()))
            # C . B^T in float32 for the backward, in specialise.cb_dtype_name's dtype for the forward.
            cbd = specialise.cb_dtype_name(dt)
            for cb_dtype in sorted({F32, cbd}):
                for diag in (False, True):
                    out.append(Spec("chunk_cb", dt, specialise.chunk_cb_constants(L, diag=diag),
                                    _params("chunk_cb", dt, cb_dtype=cb_dtype),
                                    _hints("chunk_cb", dt, L), dtypes=(("cb", cb_dtype),) if cb_dtype != F32 else ()))
            for has_seq in (False, True):
                for check in (True, False):
                    for sd in specialise.entering_dtype_names(dt):
                        extra = tuple((role, d) for role, d in (("cb", cbd), ("states", sd)) if d != F32)
                        out.append(Spec("compute_out", dt, specialise.compute_out_constants(L, has_seq, check, dt),
                                        _params("compute_out", dt, state_dtype=sd, cb_dtype=cbd),
                                        _hints("compute_out", dt, L), dtypes=extra))
                        # its carry form at each state tile up to OUT_CARRY_MAX_DSTATE
                        if not specialise.out_carry_can_run(16, L):
                            continue
                        for tn in specialise.OUT_CARRY_TILES:
                            out.append(Spec("compute_out_carry", dt,
                                            {**specialise.out_carry_constants(L, tn, has_seq, dt), "CHK": check},
                                            _params("compute_out_carry", dt, state_dtype=sd, cb_dtype=cbd),
                                            tuple(sorted(specialise.out_carry_hints(dt, tn).items())),
                                            dtypes=extra))
    # Fused scan: per dstate tile, with and without seq_idx (no hints: _hints would name none).
    for dt in INPUT_DTYPES:
        for nt in SEGMENT_NTS:
            for has_seq in (False, True):
                k = specialise.segment_constants(nt, has_seq)
                for name in ("segment_state", "segment_out"):
                    out.append(Spec(name, dt, k, _params(name, dt)))
    # state_passing also writes the entering states to their own array in each dtype besides float32 that
    # compute_out reads them in (specialise.entering_dtype_names).
    separate = sorted({d for dt in INPUT_DTYPES for d in specialise.entering_dtype_names(dt)} - {F32})
    # with each, float32 local states and bfloat16 ones where chunk_state may write them (LOCAL_STATES_IN_BF16)
    locals_with = {sd: sorted({ld for dt in INPUT_DTYPES if sd in specialise.entering_dtype_names(dt)
                               for L in CHUNK_SIZES for ld in specialise.local_dtype_names(dt, L)})
                   for sd in separate}
    for blk in STATE_BLOCKS:
        for has_seq, chk in itertools.product((False, True), (False, True)):
            out.append(Spec("state_passing", F32, specialise.state_passing_constants(blk, has_seq, check=chk),
                            _params("state_passing", F32)))
            for sd in separate:
                for ld in locals_with[sd]:
                    out.append(Spec("state_passing", F32,
                                    specialise.state_passing_constants(blk, has_seq, separate=True, check=chk),
                                    _params("state_passing", F32, state_dtype=sd, local_dtype=ld),
                                    dtypes=(("entering", sd),) + ((("local", ld),) if ld != F32 else ())))
    # Backward kernels (backward.py). Apart from
    # chunk_cumsum_bwd they take the chunk size at run time: one specialisation per token block it implies.
    for dt in INPUT_DTYPES:
        for L in CHUNK_SIZES:
            out.append(Spec("chunk_cumsum_bwd", dt, backward.chunk_cumsum_bwd_constants(L),
                            _params("chunk_cumsum_bwd", dt), _hints("chunk_cumsum_bwd", F32, L)))
        for L in sorted({min(L, 64) for L in CHUNK_SIZES}):  # one chunk size per token block
            for has_seq in (False, True):
                gl = backward.g_local_dtype_name(dt)
                for name in ("chunk_state_bwd_x", "chunk_state_bwd_b"):
                    out.append(Spec(name, dt, backward.chunk_state_bwd_constants(L, has_seq, dt),
                                    _params(name, dt, g_local_dtype=gl), _hints(name, dt, L),
                                    dtypes=(("g_local", gl),) if gl != F32 else ()))
                k4 = backward.compute_out_bwd_constants(L, has_seq, dt)
                k3 = {key: v for key, v in k4.items() if key != "TN"}
                gd = backward.g_dtype_name(dt)
                extra = (("G", gd),) if gd != F32 else ()
                for name in ("out_bwd_dcdb", "out_bwd_dstates"):
                    out.append(Spec(name, dt, k4, _params(name, dt, g_dtype=gd), _hints(name, dt, L), dtypes=extra))
                # out_bwd_dcdb also reads the forward's bfloat16 entering states (m2ops/ops/eager.py).
                for sd in sorted(set(specialise.entering_dtype_names(dt)) - {F32}):
                    out.append(Spec("out_bwd_dcdb", dt, k4, _params("out_bwd_dcdb", dt, g_dtype=gd, state_dtype=sd),
                                    _hints("out_bwd_dcdb", dt, L), dtypes=extra + (("states", sd),)))
                out.append(Spec("out_bwd_dx", dt, k3, _params("out_bwd_dx", dt, g_dtype=gd),
                                _hints("out_bwd_dx", dt, L), dtypes=extra))
                out.append(Spec("out_bwd_dcbw", dt, k3, _params("out_bwd_dcbw", dt, g_dtype=gd),
                                _hints("out_bwd_dcbw", dt, L), dtypes=extra))
    for L in CHUNK_SIZES:  # (float32 whatever the activations)
        for has_seq in (False, True):
            out.append(Spec("chunk_state_bwd_w", F32, backward.chunk_state_bwd_w_constants(L, has_seq),
                            _params("chunk_state_bwd_w", F32), _hints("chunk_state_bwd_w", F32, L)))
        out.append(Spec("out_bwd_sums", F32, backward.out_bwd_sums_constants(L), _params("out_bwd_sums", F32),
                        _hints("out_bwd_sums", F32, L)))
    g_locals = sorted({backward.g_local_dtype_name(dt) for dt in INPUT_DTYPES})
    # (states dtype, glocal dtype): float32 states with each glocal, and the forward's bfloat16 entering states
    # with bfloat16 activations' glocal (m2ops/ops/eager.py)
    pairs = [(F32, gl) for gl in g_locals] + sorted(
        {(sd, backward.g_local_dtype_name(dt)) for dt in INPUT_DTYPES
         for sd in set(specialise.entering_dtype_names(dt)) - {F32}})
    for blk in STATE_BLOCKS:  # the walk's blocks, and state_carry_grad's steps (backward.carry_block)
        for sd, gl in pairs:
            extra = tuple((role, d) for role, d in (("g_local", gl), ("states", sd)) if d != F32)
            out.append(Spec("state_carry_grad", F32, dict(BLK=blk),
                            _params("state_carry_grad", F32, g_local_dtype=gl, state_dtype=sd),
                            _hints("state_carry_grad", F32, 0), dtypes=extra))
            for has_seq in (False, True):
                # with gcarry in the walk, and without it (backward.separate_carry_grad)
                # (the walk without gcarry loads unchecked where the block divides the state)
                for gc, chk in ((True, True), (False, True), (False, False)):
                    out.append(Spec("state_passing_bwd", F32,
                                    backward.state_passing_bwd_constants(blk, has_seq, gc, check=chk),
                                    _params("state_passing_bwd", F32, g_local_dtype=gl, state_dtype=sd),
                                    _hints("state_passing_bwd", F32, 0), dtypes=extra))
    # Decode: activations' dtype x dt's and state's dtypes (decode.state_update_dtypes) x dstate tile.
    for dt in INPUT_DTYPES:
        for dt_dtype in decode.state_update_dtypes(dt):
            for state_dtype in decode.state_update_dtypes(dt):
                for tn in decode.STATE_UPDATE_TILE_NS:
                    for aligned in (False, True):  # the table's build, and the one for 16-byte rows
                        hints = tuple(sorted(decode.state_update_hints(dt, aligned).items()))
                        out.append(Spec("state_update", dt, decode.state_update_constants(tn),
                                        _params("state_update", dt, dt_dtype, state_dtype),
                                        hints, dtypes=(("dt", dt_dtype), ("state", state_dtype))))
                        # the in-place kernel: the same dtypes, tiles and hint rule, x A's and dt_bias's dtype
                        hints = tuple(sorted(decode.state_update_inplace_hints(dt, aligned).items()))
                        for pd in param_dtypes(dt):
                            out.append(Spec("state_update_inplace", dt, decode.state_update_constants(tn),
                                            _params("state_update_inplace", dt, dt_dtype, state_dtype,
                                                    param_dtype=pd),
                                            hints, dtypes=(("dt", dt_dtype), ("state", state_dtype))
                                            + ((("param", pd),) if pd != F32 else ())))
    # The gated RMSNorm (norm.py): activations' dtype x group tile, each tile with its hints; the forwards also x
    # the dtype of weight and bias (runtime.param_dtype).
    for dt in INPUT_DTYPES:
        for gt in norm.NORM_GROUP_TILES:
            out.append(Spec("gated_norm_bwd", dt, norm.norm_constants(gt), _params("gated_norm_bwd", dt),
                            norm.NORM_HINTS))
            for pd in param_dtypes(dt):
                out.append(Spec("gated_norm", dt, norm.norm_constants(gt), _params("gated_norm", dt, param_dtype=pd),
                                norm.NORM_HINTS, dtypes=(("param", pd),)))
        for nc in norm.norm_wide_fwd_tile_counts():
            for pd in param_dtypes(dt):
                out.append(Spec("gated_norm_wide", dt, norm.norm_wide_fwd_constants(nc * norm.NORM_WIDE_FWD_COLS),
                                _params("gated_norm_wide", dt, param_dtype=pd), norm.NORM_HINTS,
                                dtypes=(("param", pd),)))
        for name in ("gated_norm_wide_rows", "gated_norm_wide_bwd"):
            out.append(Spec(name, dt, norm.norm_wide_constants(), _params(name, dt), norm.NORM_HINTS))
    # The causal convolution (conv.py): activations' dtype x width (x SiLU for the backward, whose u is
    # recomputed only with it); the update x conv_state's dtype (conv.update_state_dtypes).
    for dt in INPUT_DTYPES:
        for width in conv.KERNEL_WIDTHS:
            out.append(Spec("causal_conv1d", dt, conv.conv_constants(width), _params("causal_conv1d", dt),
                            _hints("causal_conv1d", dt, 0)))
            for act in (False, True):
                out.append(Spec("causal_conv1d_bwd", dt, conv.conv_bwd_constants(width, act),
                                _params("causal_conv1d_bwd", dt), _hints("causal_conv1d_bwd", dt, 0)))
        for sd in conv.update_state_dtypes(dt):
            for pd in param_dtypes(dt):
                out.append(Spec("causal_conv1d_update", dt, conv.update_constants(),
                                _params("causal_conv1d_update", dt, state_dtype=sd, param_dtype=pd),
                                _hints("causal_conv1d_update", dt, 0), dtypes=(("state", sd), ("param", pd))))
    # Each with 64-bit-indexed arrays also as its 32-bit twin.
    out += [dataclasses.replace(s, narrow=True) for s in out if index_width.has_wide_arrays(s.kernel)]
    return out


def _signature(kernel, params, constants) -> KernelSignature:
    """Constraints in the kernel's parameter order: run-time parameters from params, in order, for the
    non-constant parameters; constants by name. Array index widths follow the kernel's annotations."""
    ann = kernel._annotated_function
    names = list(ann.pysig.parameters)
    rt = iter(params)
    constraints = []
    for name, node in zip(names, ann.parameter_annotations):
        if node.constant:
            constraints.append(constants[name])
            continue
        kind = next(rt)
        if kind[0] == "array":
            index_dtype = node.array.index_dtype if node.array is not None else ct.int32
            ndim = kind[2]
            constraints.append(ArrayConstraint(
                getattr(ct, kind[1]), ndim, index_dtype=index_dtype, stride_lower_bound_incl=0,
                alias_groups=(), may_alias_internally=False, stride_constant=(None,) * (ndim - 1) + (1,)))
        elif kind[0] == "int":
            constraints.append(ScalarConstraint(ct.int32))
        else:
            constraints.append(ScalarConstraint(ct.float32))
    if next(rt, None) is not None:
        raise ValueError(f"{kernel._pyfunc.__name__}: more run-time parameters described than it takes")
    return KernelSignature(constraints, CallingConvention.cutile_python_v2())
