#!/usr/bin/env bash
# The one script a lent GPU machine runs. Its steps, each with its own time limit:
# versions and the card's ceilings; the fused Triton kernels against the float64
# reference (check, then the CUDA tests, both with each pass's first tile
# configuration: compiling every autotuner candidate of every variant would take most
# of the lease); the benchmark with the autotuner on, side by side in one run: dense
# SDPA (FlashAttention), FlexAttention computing the same mixture, the library on its
# fused Triton kernels and on PyTorch's kernels at N=32768, then the fused kernels
# alone at N=1M; one-token decoding at 4K, 64K and 1M (eager and captured in a CUDA
# graph, one sequence and batches of 8). Everything goes into OUTDIR. Naming steps runs
# only those (check, tests, bench, bench-1m, decode), in that order: all five may take
# up to about 15 minutes, more than a 15-minute lease holds with its start and a rerun.
# Every step runs even if one before it failed; the exit status is 1 if any failed, 2
# for an unknown step or a machine without a CUDA device (then nothing is written).
#
#     PYTHONPATH=src bash benchmarks/gpu.sh OUTDIR [STEP...]
set -u
steps="check tests bench bench-1m decode"
out=${1:?usage: bash benchmarks/gpu.sh OUTDIR [check|tests|bench|bench-1m|decode ...]}
shift
for name in "$@"; do
    [[ " $steps " == *" $name "* ]] || { echo "error: unknown step $name: the steps are $steps" >&2; exit 2; }
done
wanted=" ${*:-$steps} "
export PYTHONPATH=${PYTHONPATH:-src}
card=$(python3 -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null) || {
    echo "error: no CUDA device (torch.cuda.is_available() is False, or torch failed to import): run this on the GPU machine" >&2
    exit 2
}
mkdir -p "$out"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$out/versions-$card.txt" 2>&1
cat "$out/versions-$card.txt"

step() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    [[ $wanted == *" $name "* ]] || return 0
    local start=$SECONDS
    # SIGINT at the limit: pytest then still reports the failures it has seen.
    timeout -s INT -k 15 "$seconds" "$@" > "$out/$name-$card.txt" 2>&1
    local status=$?
    echo "$name: exit $status in $((SECONDS - start)) s"
    tail -n 6 "$out/$name-$card.txt"
    [[ $status == 0 ]] || failed=1
}
failed=0

export DILATED_ATTENTION_TRITON_TUNE=0
step check 120 python3 -m dilated_attention check --device cuda --dtype bfloat16 float16 --kernel triton
step tests 240 python3 -m pytest -q --maxfail=3 -p no:cacheprovider --hypothesis-seed=0 tests/test_cuda.py
unset DILATED_ATTENTION_TRITON_TUNE
step bench 180 python3 -m dilated_attention bench --device cuda --dtype bfloat16 --heads 16 --head-dim 128 \
    --seq-lens 32768 --impl dense flex mixture mixture-torch --repeats 5 --max-seconds 20 --no-plot --quiet \
    --out-dir "$out" --name "bench-cuda-bfloat16-$card"
step bench-1m 90 python3 -m dilated_attention bench --device cuda --dtype bfloat16 --heads 16 --head-dim 128 \
    --seq-lens 1048576 --impl mixture --repeats 3 --max-seconds 30 --no-plot --quiet \
    --out-dir "$out" --name "bench-1m-cuda-bfloat16-$card"
step decode 240 python3 -m dilated_attention decode-bench --device cuda --dtype bfloat16 --heads 16 --head-dim 128 \
    --positions 4096 65536 1048576 --steps 50 --dense-steps 10 --no-plot --out-dir "$out" \
    --name "decode-cuda-bfloat16-$card"
exit $failed
