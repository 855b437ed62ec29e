"""Run another script with the public function's direct eager path turned off (every call through the custom
ops), to compare host times:

    python measure/ops_path.py measure/host_scan.py --shapes 4K:128
"""
import os
import runpy
import sys

import harness  # noqa: F401 - puts tests/gpu (gpu_cases) and the repository on sys.path

from m2ops.ops import eager

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0 if len(sys.argv) > 1 else 2)
eager.applies = lambda *tensors: False
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # the script's own folder, as python would
runpy.run_path(sys.argv[0], run_name="__main__")
