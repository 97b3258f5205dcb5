#!/usr/bin/env bash
# llama.cpp, for the single-stream comparison of bench/quantized.py: llama-cpp-python built from its
# source distribution (which carries llama.cpp itself) into a venv of its own, bench/.llamacpp-venv/.
#
#     bash bench/setup_llamacpp.sh          # idempotent: a second run only checks the import
#
# CPU build for this machine (GGML_NATIVE: the instruction sets of the CPU it builds on), OpenMP on,
# no BLAS: what `pip install llama-cpp-python` builds by default. About 10 minutes on 2 cores.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$BENCH/.llamacpp-venv"
PY="$VENV/bin/python"

check() { "$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"; }

if [[ -x "$PY" ]] && check 2>/dev/null; then
    exit 0
fi
[[ -x "$PY" ]] || python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" \
    "$PY" -m pip install --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
check
