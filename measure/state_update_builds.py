"""state_update's sm_90 builds at several occupancy hints, for the stride classes of chosen decode shapes, as a
script (no GPU needed: cuTile's export_kernel and cuobjdump):

    python measure/state_update_builds.py [--shapes 50:100,50:128,64:100] [--occupancy 0,2,4,8] [--keep DIR]

Each shape is headdim:dstate (batch 3, 8 heads, 1 group, bfloat16 x/B/C/z/dt and state, float32 A, D per
channel, dt_bias). The arrays' constraints follow the runtime's rule as cuTile's JAX binding states it (a stride
divisible by 16 bytes or not, a dimension divisible by 16 or not, unit strides constant) with the 32-bit-indexed
twin that launches of this size take. Per build: registers, stack (spills), shared memory, TMA loads and stores,
plain global loads and stores, local-memory traffic, as a markdown table. docs/history.md v28 reads these
for the build that computed wrong values at occupancy 4 and 8. cuobjdump: $CUOBJDUMP or the one on PATH.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile

import cuda.tile as ct
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint,
                                   export_kernel)

import harness  # first of the local imports: it puts the repository on sys.path

from m2ops.kernels import decode, index_width, specialise
from m2ops.kernels.state_update import state_update_kernel

_BITS = {"bfloat16": 16, "float32": 32}
OPS = ("UTMALDG", "UTMASTG", "LDG", "STG", "LDS", "STS", "LDL", "STL")


def _contiguous(shape):
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def _array(dtype, shape):
    strides, per16 = _contiguous(shape), 128 // _BITS[dtype]
    return ArrayConstraint(getattr(ct, dtype), len(shape), index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=tuple(1 if s == 1 else None for s in strides),
                           shape_constant=tuple(1 if d == 1 else None for d in shape),
                           stride_divisible_by=tuple(per16 if s != 1 and s % per16 == 0 else 1 for s in strides),
                           shape_divisible_by=tuple(16 if d % 16 == 0 else 1 for d in shape),
                           base_addr_divisible_by=16)


def signature(kernel, headdim, dstate, batch=3, nheads=8, ngroups=1):
    bf, f32 = "bfloat16", "float32"
    state, tok, bc = (batch, nheads, headdim, dstate), (batch, nheads, headdim), (batch, ngroups, dstate)
    arrays = dict(state=_array(bf, state), x=_array(bf, tok), dt=_array(bf, (batch, nheads)),
                  A=_array(f32, (nheads,)), B=_array(bf, bc), C=_array(bf, bc), D=_array(f32, (nheads, headdim)),
                  z=_array(bf, tok), dt_bias=_array(f32, (nheads,)), new_state=_array(bf, state), y=_array(bf, tok))
    constants = decode.state_update_constants(decode.state_update_tile_n(dstate))
    ann = kernel._annotated_function
    out = []
    for name, node in zip(ann.pysig.parameters, ann.parameter_annotations):
        if node.constant:
            out.append(constants[name])
        elif name in arrays:
            out.append(arrays[name])
        else:
            out.append(ScalarConstraint(ct.float32 if name in ("dt_min", "dt_max") else ct.int32))
    return KernelSignature(out, CallingConvention.cutile_python_v2())


def _opcode(line):
    """The base opcode of a SASS line ("/*0090*/  @P0 LDG.E.128 R4, ..." -> "LDG"), or None."""
    if "*/" not in line:
        return None
    words = line.split("*/", 1)[1].split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else None


def build(occupancy, headdim, dstate, cuobjdump, keep=None):
    kernel = specialise.hinted("state_update", (("occupancy", occupancy),)) if occupancy else state_update_kernel
    kernel = index_width.narrow_twin(kernel)
    buf = io.BytesIO()
    export_kernel(kernel, [signature(kernel, headdim, dstate)], buf, gpu_code="sm_90", output_format="cubin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(keep or tmp, f"state_update_occ{occupancy}_p{headdim}_n{dstate}.cubin")
        with open(path, "wb") as f:
            f.write(buf.getvalue())
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        if keep:
            with open(path + ".sass", "w") as f:
                f.write(sass)
    fields = dict(kv.split(":") for line in usage.splitlines() if "REG:" in line for kv in line.split() if ":" in kv)
    ops = dict.fromkeys(OPS, 0)
    for op in map(_opcode, sass.splitlines()):
        if op in ops:
            ops[op] += 1
    return dict(occupancy=occupancy or "none", headdim=headdim, dstate=dstate, registers=fields.get("REG"),
                stack=fields.get("STACK"), shared=fields.get("SHARED"), **ops)


def main():
    ap = harness.parser(__doc__)
    harness.add_shapes(ap, "50:100,50:128,64:100,64:128", help="comma-separated headdim:dstate")
    ap.add_argument("--occupancy", type=harness.sizes, default="0,2,4,8", help="0: no hint")
    ap.add_argument("--keep", default=None, help="directory for the cubins and their SASS")
    args = ap.parse_args()
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not cuobjdump:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP")
    table = harness.Table([("headdim", "headdim"), ("dstate", "dstate"), ("occupancy", "occupancy"),
                           ("registers", "registers"), ("stack", "stack B"), ("shared", "shared B"), *OPS])
    table.header()
    for p, n, _ in args.shapes:
        for occ in args.occupancy:
            table.row(build(occ, p, n, cuobjdump, args.keep))


if __name__ == "__main__":
    main()
