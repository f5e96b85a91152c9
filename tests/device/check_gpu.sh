#!/usr/bin/env bash
# The GPU check (issue 35, item 7): on a machine with an NVIDIA GPU, with no network,
# install gguf-cpp's CUDA variant through localrt's API (compiled for this GPU), start
# a generated model and a 1B-shaped one with ngl unset (fit), and print their layers and
# bytes on the GPU, `localrt ps`, and decode tok/s against the CPU build and against
# llama-server from the same sdist. tests/device/check_gpu.py does the steps; this
# wrapper checks what it needs first and bounds it all to under 10 minutes.
#
#   tests/device/check_gpu.sh            # from the repository root
#   CHECK_GPU_LIMIT=560 CHECK_GPU_KEEP=1 tests/device/check_gpu.sh   # keep /tmp/check-gpu-*
#
# It needs: the venv (.venv, or PYTHON=...), a C/C++ compiler, and the files
# `python3 -m localrt.bootstrap --test` downloads: tests/.rpc-build/sources (the
# llama-cpp-python sdist, scikit-build-core, cmake, ninja) and tests/.cuda-build/toolkit
# (the CUDA 13 toolkit's wheels, ~650 MB). The compiled variant needs an NVIDIA driver
# for CUDA 13 (580 or newer). The last line is one summary: CHECK_GPU OK ... or
# CHECK_GPU FAIL <step>: <why>.
set -euo pipefail

cd "$(dirname "$0")/../.."
LIMIT="${CHECK_GPU_LIMIT:-560}"   # seconds for the driver; the wrapper adds ~20
export CHECK_GPU_LIMIT="$LIMIT"
PYTHON="${PYTHON:-.venv/bin/python}"

fail() { echo "CHECK_GPU FAIL $1"; exit 1; }

echo "== 0/7 what this check needs"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3 || true)"
[ -n "$PYTHON" ] || fail "setup: no Python (set PYTHON or make .venv)"
"$PYTHON" -c "import llama_cpp, localrt" 2>/dev/null \
    || fail "setup: $PYTHON cannot import llama_cpp and localrt (python3 -m localrt.bootstrap --test)"
command -v cc >/dev/null && command -v c++ >/dev/null \
    || fail "setup: no C/C++ compiler (build-essential)"
if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free,compute_cap \
        --format=csv,noheader || echo "   nvidia-smi failed; NVML decides"
else
    echo "   no nvidia-smi; NVML decides"
fi
ls tests/.rpc-build/sources/llama_cpp_python-*.tar.gz >/dev/null 2>&1 \
    || fail "setup: tests/.rpc-build/sources has no llama-cpp-python sdist (python3 -m localrt.bootstrap --test)"
ls tests/.cuda-build/toolkit/nvidia_cuda_nvcc-*.whl >/dev/null 2>&1 \
    || fail "setup: tests/.cuda-build/toolkit has no CUDA toolkit wheels (python3 -m localrt.bootstrap --test)"
echo "   $("$PYTHON" --version), $(nproc) cores, $(free -g | awk '/Mem:/ {print $7 " GiB free"}')"

set +e
timeout --signal=TERM --kill-after=15 "$((LIMIT + 10))" "$PYTHON" tests/device/check_gpu.py
code=$?
set -e
if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    fail "timeout: the check ran past ${LIMIT} s (its last step is above)"
fi
exit "$code"
