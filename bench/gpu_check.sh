#!/usr/bin/env bash
# One device call: the whole test suite on the GPU image's torch, then the end-to-end benchmark (with what its
# targets ask of each part) and the demo. Usage on the GPU machine, from the repo root:
#   OUT=<dir> bash bench/gpu_check.sh
# Its own records are named after it (gpu_check_env.txt, gpu_check_tests.txt, gpu_check_demo.txt); with the default
# OUT they land beside the block's results in bench/results/.
set -uo pipefail
OUT=${OUT:-bench/results}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/gpu_check_env.txt"
python3 -m pytest -q -x -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tail -n 40 > "$OUT/gpu_check_tests.txt"
tail -n 5 "$OUT/gpu_check_tests.txt"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 bench/block.py --out "$OUT" 2>&1 | tail -n 20
  python3 bench/block_targets.py --out "$OUT" 2>&1 | tail -n 8
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  python3 -m latent_moe_fusion demo 2>&1 | tail -n 40 | tee "$OUT/gpu_check_demo.txt"
fi
