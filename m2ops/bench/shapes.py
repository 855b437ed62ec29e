"""Benchmark shapes and their floors (docs/benchmarks.md): bytes / 4.3 TB/s and FLOPs / 790 TFLOP/s, the larger."""

from __future__ import annotations

from dataclasses import asdict, dataclass

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, measured
MMA_FLOPS_PER_S = 790e12  # H200 bf16 matrix product, measured
FLOOR_CHUNK = 64  # FLOPs are counted for the chunked algorithm at this chunk size

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_sizes(text: str) -> list[int]:
    """"1K,4K,128" -> [1024, 4096, 128]: comma-separated positive ints, a K (or k) suffix multiplying by 1024.
    Raises ValueError naming the expected form."""
    out = []
    for v in text.split(","):
        v = v.strip()
        digits = v[:-1] if v[-1:] in ("K", "k") else v
        if not (digits.isascii() and digits.isdigit()) or int(digits) == 0:
            raise ValueError(f"expected comma-separated positive sizes such as 1K,4K,128 (K: times 1024); "
                             f"got {text!r}")
        out.append(int(digits) * (1024 if digits != v else 1))
    return out


@dataclass(frozen=True)
class Shape:
    seqlen: int
    dstate: int
    batch: int = 1
    nheads: int = 80
    headdim: int = 64
    ngroups: int = 1
    dtype: str = "bfloat16"

    @property
    def key(self) -> str:
        return (f"b{self.batch}_t{self.seqlen}_h{self.nheads}_p{self.headdim}_g{self.ngroups}_n{self.dstate}_"
                f"{self.dtype}")

    def as_dict(self):
        return asdict(self)

    def bytes_moved(self) -> int:
        """x, B, C, dt read, y written, initial state read and final state written (fp32)."""
        e = DTYPE_BYTES[self.dtype]
        tokens = self.batch * self.seqlen
        io = tokens * (2 * self.nheads * self.headdim * e + 2 * self.ngroups * self.dstate * e + self.nheads * 4)
        return io + 2 * self.batch * self.nheads * self.headdim * self.dstate * 4

    def flops(self) -> int:
        """Matrix FLOPs of the chunked form: C·Bᵀ per group, the masked product, the state in and out."""
        L, n, p = FLOOR_CHUNK, self.dstate, self.headdim
        chunks = self.batch * -(-self.seqlen // L)
        per_chunk = self.ngroups * 2 * L * L * n + self.nheads * (2 * L * L * p + 4 * L * n * p)
        return chunks * per_chunk

    def floor_ms(self, backward: bool = False) -> float:
        """Forward: its bytes and FLOPs. Forward+backward: the backward reads the same inputs plus dy and
        writes a gradient of each (twice the bytes in all) and does two matrix products per forward one
        (three times the FLOPs in all)."""
        bytes_, flops = self.bytes_moved(), self.flops()
        if backward:
            bytes_, flops = 2 * bytes_, 3 * flops
        return 1e3 * max(bytes_ / HBM_BYTES_PER_S, flops / MMA_FLOPS_PER_S)


def grid(seqlens, dstates, **common):
    return [Shape(seqlen=t, dstate=n, **common) for t in seqlens for n in dstates]
