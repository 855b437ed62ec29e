"""The ranks a context-parallel call spans: which group, this rank's place in it, the check that every rank
called with agreeing inputs, and the one gather of the exchange.

A rank whose inputs fail its own checks must not leave the others waiting in a collective: every rank first
checks its slice locally, then all ranks exchange a small fixed-size description of their call (check passed,
sizes, dtypes, options) and compare it, so that a bad slice on one rank raises on every rank.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..meta.validate import should_check_values

WHERE = "m2ops.distributed.mamba_chunk_scan_combined"

# torch 2.13 renamed the autograd-aware gather; 2.11 has only the old name.
_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def resolve(group):
    """group (None: the default group; a ProcessGroup; a 1-D DeviceMesh; (mesh, dim)) -> (process group, this
    process's rank in it, its size). Raises TypeError / ValueError naming `group`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{WHERE}: group needs an initialized torch.distributed (call "
                         "torch.distributed.init_process_group first); it is not initialized")
    pg = _process_group(group)
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(f"{WHERE}: group must contain this process (global rank {dist.get_rank()}); its ranks are "
                         f"{dist.get_process_group_ranks(pg)}")
    return pg, rank, dist.get_world_size(pg)


def _process_group(group):
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out
        raise ValueError(f"{WHERE}: group must contain this process (global rank {dist.get_rank()}); got the "
                         "group that torch.distributed.new_group returned to a rank outside it")
    mesh, dim = group if isinstance(group, tuple) and len(group) == 2 else (group, None)
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(mesh, DeviceMesh):
        if dim is None and mesh.ndim != 1:
            raise ValueError(f"{WHERE}: group must be a 1-D DeviceMesh or (mesh, dim); got a {mesh.ndim}-D mesh "
                             f"(dims {mesh.mesh_dim_names}): pass mesh['cp'] or (mesh, 'cp')")
        return mesh.get_group(dim)
    raise TypeError(f"{WHERE}: group must be None, a torch.distributed ProcessGroup, a 1-D DeviceMesh or "
                    f"(DeviceMesh, dim); got {type(group).__name__}")


def gather(t: torch.Tensor, pg) -> torch.Tensor:
    """(size,) from every rank -> (world, size), rank order. Autograd: the gradient of a rank's piece is the sum
    over ranks of the gradients of their gathered copies (a reduce-scatter). A functional collective, so
    torch.compile traces it."""
    return _gather_autograd(t, 0, pg).view(-1, t.shape[0])


# ---- agreement of the ranks' calls ----

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)

# What every rank's call must agree on, in the order of the exchanged description (after its first field, the
# rank's own check: 1 passed, 0 failed). seqlen may differ.
FIELDS = ("batch", "nheads", "headdim", "ngroups", "dstate", "chunk_size", "x.dtype", "dt.dtype", "A.dtype",
          "B.dtype", "C.dtype", "D", "D.dtype", "z", "z.dtype", "dt_bias", "dt_bias.dtype", "initial_states",
          "initial_states.dtype", "seq_idx", "seq_idx.dtype", "dt_softplus", "dt_limit[0]", "dt_limit[1]",
          "return_final_states", "gradients", "x.device.type")


def dtype_code(t):
    return -1 if t is None else _DTYPES.index(t.dtype)


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def describe(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
             return_final_states, needs_grad) -> list[int]:
    """The FIELDS of a call whose inputs passed the local checks, as ints."""
    b, _, h, p = x.shape
    g, n = B.shape[2:]
    return [b, h, p, g, n, chunk_size, dtype_code(x), dtype_code(dt), dtype_code(A), dtype_code(B),
            dtype_code(C), -1 if D is None else D.dim(), dtype_code(D), int(z is not None), dtype_code(z),
            int(dt_bias is not None), dtype_code(dt_bias), int(initial_states is not None),
            dtype_code(initial_states), int(seq_idx is not None), dtype_code(seq_idx), int(dt_softplus),
            _float_bits(dt_limit[0]), _float_bits(dt_limit[1]), int(return_final_states), int(needs_grad),
            0 if x.device.type == "cpu" else 1]


def checks_exchanged(x) -> bool:
    """Whether the ranks compare their calls: the comparison is read on the host, so not while torch.compile
    traces or a CUDA graph captures, nor with M2OPS_CHECK_VALUES=0 (like the plain call's checks of seq_idx)."""
    return should_check_values(x)


def agree(pg, rank: int, error: Exception | None, describe_call, device, exchanged: bool, names=FIELDS,
          where=WHERE):
    """The ranks' checks of one call: raise `error` (this rank's local checks failed) right away where the ranks do
    not exchange (checks_exchanged), else check_agreement with describe_call()'s fields (called only when this
    rank's checks passed)."""
    if not exchanged:
        if error is not None:
            raise error
        return
    check_agreement(pg, rank, None if error is not None else describe_call(), error, device, names, where)


def check_agreement(pg, rank: int, fields: list[int] | None, error: Exception | None, device, names=FIELDS,
                    where=WHERE):
    """Exchange every rank's description (fields, one int per name; None with `error` where the local checks
    failed) and raise the same way on every rank when a rank failed its checks or two ranks disagree: one small
    gather, and a device-to-host copy of its result."""
    row = [1] + fields if fields is not None else [0] + [-1] * len(names)
    rows = gather(torch.tensor(row, dtype=torch.int64, device=device), pg).tolist()
    failed = [r for r, row in enumerate(rows) if row[0] == 0]
    if failed:
        if error is not None:
            raise error
        raise ValueError(f"{where}: the inputs of rank(s) {failed} of the group failed their checks (each says "
                         "why); no rank computed anything")
    for i, name in enumerate(names):
        values = [row[1 + i] for row in rows]
        if any(v != values[0] for v in values):
            raise ValueError(f"{where}: {name} must be the same on every rank of the group; got, by rank, "
                             f"{[_readable(name, v) for v in values]}")


def _readable(name, v):
    if name.endswith(".dtype"):
        return None if v < 0 else str(_DTYPES[v]).replace("torch.", "")
    if name.startswith("dt_limit"):
        return struct.unpack("<d", struct.pack("<q", v))[0]
    if name == "x.device.type":
        return "cpu" if v == 0 else "cuda"
    if name == "D":
        return {-1: None, 1: "(nheads,)", 2: "(nheads, headdim)"}.get(v, v)
    return v
