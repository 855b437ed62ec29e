"""m2ops: the Mamba-2 SSD scan as torch.library custom ops, with cuTile kernels on NVIDIA GPUs and a
pure-PyTorch chunked reference everywhere else.

    from m2ops import mamba_chunk_scan_combined   # instead of mamba_ssm.ops.triton.ssd_combined
"""

from . import ops
from .conv1d import causal_conv1d_fn, causal_conv1d_update
from .gated_norm import rms_norm_gated
from .layer import Mamba2
from .ops.state_update import selective_state_update_functional
from .ops.state_update_inplace import selective_state_update
from .scan_combined import mamba_chunk_scan_combined
from .scan_varlen import VarlenMeta, mamba_chunk_scan_combined_varlen, prepare_varlen

__version__ = "0.1.0"
__all__ = ["Mamba2", "mamba_chunk_scan_combined", "selective_state_update", "selective_state_update_functional",
           "rms_norm_gated", "causal_conv1d_fn", "causal_conv1d_update", "pretune", "ops", "__version__",
           "mamba_chunk_scan_combined_varlen", "prepare_varlen", "VarlenMeta"]


def __getattr__(name):
    # m2ops.pretune, imported on first use so that `python -m m2ops.tuning` runs its module only once.
    if name == "pretune":
        from .tuning import pretune
        return pretune
    # m2ops.distributed (context parallelism), imported on first use: it imports torch.distributed.
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'm2ops' has no attribute {name!r}")
