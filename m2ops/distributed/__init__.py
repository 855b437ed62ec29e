"""Context parallelism on torch.distributed: a sequence split across the ranks of a group (and, for the layer,
tensor parallelism: its heads split across them).

    from m2ops.distributed import mamba_chunk_scan_combined   # each rank passes its slice, group=...
    m2ops.Mamba2(..., cp_group=group)                         # the layer on this rank's slice
    m2ops.Mamba2(..., process_group=group)                    # tensor parallelism: heads split (tensor_parallel.py)

See docs/distributed.md: usage, what is exchanged, the cost model.
"""

from .scan import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined"]
