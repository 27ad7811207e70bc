"""Where the time of one dilated-attention call goes on CUDA (torch.profiler): the
kernels by total CUDA time, for the GPU issue's configuration (bf16, B=1, H=16,
D=128, w = [2048, 4096, 8192], r = [1, 2, 4]), forward and forward + backward.

    PYTHONPATH=src python3 benchmarks/gpu_profile.py [N]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dilated_attention import dilated_attention

length = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
q, k, v = (torch.randn(1, length, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
branches = ([2048, 4096, 8192], [1, 2, 4])


def forward():
    with torch.no_grad():
        return dilated_attention(q, k, v, *branches)


def forward_backward():
    out = dilated_attention(q, k, v, *branches)
    return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


for name, fn in (("forward", forward), ("forward + backward", forward_backward)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"== {name}, N={length}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
