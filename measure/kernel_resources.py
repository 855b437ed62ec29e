"""Registers, stack frame and spills of kernel specialisations, built for sm_90 here, without a GPU.

    .venv/bin/python measure/kernel_resources.py chunk_state,chunk_cb [--match bfloat16,L=256] [--ptx-hash] [--narrow]

Each specialisation of m2ops.kernels.specs.all_specs() whose kernel is named (and whose name contains every
--match string; with --narrow its 32-bit-indexed twin, which the launchers take where the arrays fit) is exported
to an sm_90 cubin, built as the runtime builds it for arrays of the usual sizes: base addresses 16-byte aligned,
strides (other than the unit one) multiples of 8 elements and every extent a multiple of 16, the facts cuTile
specialises a launch on (read from the kernel names a profiler shows, e.g. `_6i16_p16`). Those facts decide the
register layout and the loads: a (32, 128) bfloat16 tile whose channel extent is not known a multiple of 16 is
loaded 2 bytes at a time, with it as 16-byte vectors (the causal convolution's forward: 142 registers without
them, 214 with, and 227 KB of shared memory either way). --as-specified builds the signatures of specs.py as they
are (what the compile test builds). The cubin carries the PTX tileiras generated (its section
.nv_debug_ptx_txt); with the line-number directives and the source section dropped, the CUDA wheel's own ptxas
compiles it again with -v, which prints what the kernel uses. --ptx-hash adds a hash of that PTX, so that two
trees can be compared: the same hash is the same code. Why: tileiras does not report resources, and the GPU
machine is not always at hand (docs/history.md v37 used this to read compute_out_carry's spills).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import re
import struct
import subprocess
import tempfile

from cuda.tile.compilation import ArrayConstraint, export_kernel

import harness  # first of the local imports: it puts the repository on sys.path

from m2ops.kernels.specs import all_specs


def elf_section(blob: bytes, wanted: str) -> bytes:
    """The contents of the ELF64 section named wanted."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)

    def header(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", blob, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = blob.index(b"\0", str_off + name)
        if blob[str_off + name:end].decode() == wanted:
            return blob[offset:offset + size]
    raise KeyError(wanted)


def clean_ptx(text: str) -> str:
    """The PTX (its lines NUL-separated in the section) without debug line directives, DWARF sections and the
    trailing intermediate-source section (ptxas rejects them without the files they name)."""
    text = text.replace("\0", "\n").split(".section .nv_intermediate_source_section")[0]
    text = re.split(r"^\s*\.section\s+\.debug", text, maxsplit=1, flags=re.M)[0]  # DWARF naming the files dropped
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"\s*\.(loc|file)\b", line))


def ptxas():
    """The CUDA wheel's ptxas (the one tileiras uses)."""
    import nvidia.cu13
    return os.path.join(list(nvidia.cu13.__path__)[0], "bin", "ptxas")


def runtime_like(signature):
    """The signature with every array as a launch usually sees it: 16-byte aligned, strides multiples of 8
    elements, extents multiples of 16."""
    def arr(c):
        if not isinstance(c, ArrayConstraint):
            return c
        unit = tuple(v == 1 for v in (c.stride_constant or (None,) * c.ndim))
        return dataclasses.replace(c, base_addr_divisible_by=16, shape_divisible_by=(16,) * c.ndim,
                                   stride_divisible_by=tuple(1 if u else 8 for u in unit))
    return dataclasses.replace(signature, parameters=[arr(c) for c in signature.parameters])


def resources(spec, as_specified: bool = False) -> tuple[str, str]:
    """(ptxas -v's summary line, hash of the cleaned PTX) of one specialisation."""
    buf = io.BytesIO()
    sig = spec.signature() if as_specified else runtime_like(spec.signature())
    export_kernel(spec.kernel, [sig], buf, gpu_code="sm_90", output_format="cubin")
    ptx = clean_ptx(elf_section(buf.getvalue(), ".nv_debug_ptx_txt").decode(errors="replace"))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    report = out.stdout + out.stderr
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    regs = re.search(r"Used (\d+) registers", report)
    smem = re.search(r"(\d+) bytes smem", report)
    if not (frame and regs):
        return f"ptxas: {report.strip()[-300:]}", ""
    summary = (f"{regs.group(1)} registers, {frame.group(1)} B stack, {frame.group(2)} B spill stores, "
               f"{frame.group(3)} B spill loads, {smem.group(1) if smem else 0} B shared memory")
    return summary, hashlib.sha1(ptx.encode()).hexdigest()[:12]


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("kernels", type=harness.names,
                    help="comma-separated kernel names of specs.py (chunk_state, compute_out_carry, ...)")
    ap.add_argument("--match", type=harness.names, default="", help="comma-separated strings each name must contain")
    ap.add_argument("--ptx-hash", action="store_true")
    ap.add_argument("--narrow", action="store_true",
                    help="the 32-bit-indexed twins instead (what the launchers take where the arrays fit)")
    ap.add_argument("--as-specified", action="store_true",
                    help="build specs.py's signatures as they are, without the run-time facts")
    args = ap.parse_args()
    names, match = set(args.kernels), args.match
    for spec in all_specs():
        if spec.narrow != args.narrow or spec.kernel_name not in names or not all(m in spec.name for m in match):
            continue
        try:
            summary, digest = resources(spec, args.as_specified)
        except Exception as e:  # noqa: BLE001 - reported per specialisation
            summary, digest = f"failed: {e!r}"[:300], ""
        print(f"{spec.name}: {summary}" + (f"  ptx {digest}" if args.ptx_hash else ""), flush=True)


if __name__ == "__main__":
    main()
