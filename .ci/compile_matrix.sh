#!/usr/bin/env bash
# Offline sm_90 compile of every Triton, Gluon and CuTe kernel under each supported Triton: the venv's own (the
# newest, with the newest torch) and the older ones the other supported torch versions pin, each installed into a
# folder of its own and put first on PYTHONPATH for the compile tests alone. Triton's bundled ptxas does the compile;
# no GPU is needed. Usage (from the repository root, after `make install`): bash .ci/compile_matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CACHE=${CACHE:-.ci-cache}
TESTS="tests/test_gluon_compile_sm90.py tests/test_kernels_compile_sm90.py tests/test_pdl_compile_sm90.py
       tests/test_peer_exchange_compile_sm90.py tests/test_route_compile_sm90.py tests/test_routed_gemv_compile_sm90.py
       tests/test_staged_compile_sm90.py tests/test_routed_fp8.py tests/test_tail_cute_compile.py
       tests/test_w4a8_compile_sm90.py tests/test_kappa_compile_sm90.py"
for version in 3.6.0 3.7.1; do
  target="$CACHE/triton-$version"
  [ -d "$target/triton" ] || "$PY" -m pip install -q --no-deps --target "$target" "triton==$version"
  echo "== offline sm_90 compiles under Triton $version"
  # a Triton cache of its own per release: compiled kernels of one release never serve another
  PYTHONPATH="$PWD/$target:$PWD" TRITON_CACHE_DIR="$PWD/$CACHE/triton-cache-$version" \
    "$PY" -m pytest -q -p no:cacheprovider $TESTS
done
echo "== the venv's Triton ($("$PY" -c 'import triton; print(triton.__version__)')) compiles in the main suite (make test)"
