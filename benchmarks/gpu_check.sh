#!/usr/bin/env bash
# The GPU path: every exact method against naive greedy on CUDA (tiny random models), every batching
# method's rows against the rows alone (greedy and seeded sampling), the CUDA
# sampling test, and device-vs-CPU logits.  Run on a machine with a GPU and torch installed:
#   PYTHONPATH=src bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
LAYERLEAP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_exactness.py \
  tests/test_batching.py "tests/test_generate.py::test_seeded_sampling_on_cuda" "$@"
