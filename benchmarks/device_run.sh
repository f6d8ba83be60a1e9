#!/usr/bin/env bash
# One call on the GPU device machine: install the carried wheels, run the GPU test suite (and the
# CPU suite under the device's torch), write GPU-made golden checkpoints, run the GPU benchmark.
#   run(command="bash benchmarks/device_run.sh [--small]", carry=[".whl"])
# .whl: ../shared/tools/device-wheels.sh crc32c cffi pycparser (nvCOMP, zstandard, the CRC32C
# fallback, and zstandard's cffi backend, whose literal-only frames tests/gpu decodes).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# nvdcp's optional native pieces (batched CRC32C, GDeflate guard); nvdcp works without them.
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || echo "native extensions not built (see /tmp/build_ext.log)"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NVDCP_GPU_GOLDEN_OUT=$OUT
python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu ${TESTS_EXTRA:-} 2>&1 | grep -vE "^(DEBUG|INFO) " | tail -60 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ "$tests_rc" != 0 ] && [ "${BENCH_IF_TESTS_FAIL:-0}" != 1 ]; then
  echo "GPU tests failed (rc $tests_rc): benchmarks skipped (BENCH_IF_TESTS_FAIL=1 runs them anyway)"
  exit "$tests_rc"
fi
if [ "${RUN_ASYNC:-0}" = 1 ]; then
  python3 -m benchmarks.async_bench --out "$OUT" 2>&1 | grep -v "UserWarning\|return func" | tail -30
fi
if [ "${RUN_PROBE:-0}" = 1 ]; then
  python3 -m benchmarks.gpu_phase_probe 2>&1 | grep -v "Warn\|detach\|float(loss)"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m benchmarks.gpu_bench --out "$OUT" "$@" 2>&1 | tail -60
fi
