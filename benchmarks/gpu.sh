#!/usr/bin/env bash
# The one script a lent GPU machine runs (about 7 minutes): versions, the library
# against the float64 reference on CUDA in every dtype, the CUDA tests, and the
# benchmark beside dense FlashAttention (SDPA). Everything goes into OUTDIR.
#
#     PYTHONPATH=src bash benchmarks/gpu.sh OUTDIR
set -u
out=${1:?usage: bash benchmarks/gpu.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src}
card=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$out/versions-$card.txt" 2>&1
cat "$out/versions-$card.txt"

step() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$out/$name-$card.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s"
    tail -n 4 "$out/$name-$card.txt"
}

step flash 60 python3 benchmarks/gpu_flash_layouts.py
step check 80 python3 -m dilated_attention check --device cuda --dtype float64 float32 bfloat16 float16
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step bench 180 python3 -m dilated_attention bench --device cuda --dtype bfloat16 --heads 16 --head-dim 128 \
    --seq-lens 32768 1048576 --impl dense mixture --repeats 5 --max-seconds 20 --no-plot --quiet \
    --out-dir "$out" --name "bench-cuda-bfloat16-$card"
step decode 100 python3 -m dilated_attention decode-bench --device cuda --dtype bfloat16 --heads 16 --head-dim 128 \
    --positions 4096 65536 1048576 --steps 50 --dense-steps 10 --no-plot --out-dir "$out" \
    --name "decode-cuda-bfloat16-$card"
