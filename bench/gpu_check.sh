#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the compiled Triton kernels and
# the engine on the device (tests), the target's paged attention vs gather +
# SDPA (bench/paged_attention.py), speculation vs none on the GPU with gather +
# SDPA and, at the large batches, with the paged kernel (bench/spec.py), and the
# draft's kernel timings (bench/kernel_timings.py).
#
#   bash bench/gpu_check.sh [OUT_DIR]       # default bench/out/gpu
#
# Uses the python3 on PATH (or $PYTHON) with torch+triton already installed;
# the repository is put on PYTHONPATH, so no install step is needed. Each
# step has its own time limit, cut to what is left of the whole run's
# (GPU_CHECK_SECONDS, default 780: a 15-minute device lease less start-up),
# and the script goes on after a failure; the exit status is the number of
# failed or skipped steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-780}))
failed=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 left=$((deadline - SECONDS))
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "=== $name: skipped, the run's time is spent"
        failed=$((failed + 1))
        return
    fi
    echo "=== $name ($(date +%T), ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

step env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
    $py -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.cuda.get_device_name())'"
step tests 240 "$py" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_kernels_cuda.py tests/test_engine_cuda.py \
    tests/test_model_fp8.py::test_cuda_fp8_gemm_matches_its_reference \
    tests/test_memory_plan.py::test_on_cuda_the_pool_is_sized_from_memory_and_a_hopeless_deployment_is_refused_before_loading
step paged_attention 120 "$py" bench/paged_attention.py
step spec 200 "$py" bench/spec.py --device cuda --no-transformers --batches 1 8 32 64 --max-tokens 64 --threads 4 --eager-draft
step spec_paged 90 "$py" bench/spec.py --device cuda --no-transformers --batches 32 64 --max-tokens 64 \
    --threads 4 --paged-attention
step kernels 100 "$py" bench/kernel_timings.py
exit "$failed"
