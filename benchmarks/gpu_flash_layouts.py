"""On CUDA: the FlashAttention kernel's output and gradients against the unfused
kernel (float32 operands), for operands as they come and in the op's output layout,
with the shapes the engine makes (strided rows, padded head dims, GQA, causal)."""

import torch

import dilated_attention.ops.kernels as kernels
from dilated_attention.tools.check import max_relative_error

original = kernels._pad_head_dim
for variant in ("as they come", "output layout"):
    kernels._pad_head_dim = (
        original if variant == "as they come" else (lambda *ts, output_layout=False: original(*ts, output_layout=True))
    )
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        for dim in (5, 8, 64, 128):
            for heads, kv in ((4, 4), (8, 2)):
                for causal in (False, True):
                    for rate in (1, 2):
                        g = torch.Generator().manual_seed(dim * 10 + heads)
                        base = torch.randn(3, 2 * 41, heads, dim, generator=g)  # (B, N, H, D), rows taken every `rate`
                        q = base[:, ::rate][:, :41].transpose(1, 2).to("cuda", dtype)
                        k, v = (torch.randn(3, kv, 41, dim, generator=g).to("cuda", dtype) for _ in range(2))
                        grad = torch.randn(3, heads, 41, dim, generator=g).to("cuda", dtype)
                        o, lse = kernels.CudaFlashKernel.forward(q, k, v, None, causal, dim**-0.5)
                        grads = kernels.CudaFlashKernel.backward(grad, q, k, v, o, lse, None, causal, dim**-0.5)
                        f = [t.float() for t in (q, k, v, grad)]
                        ro, rl = kernels.MathKernel.forward(*f[:3], None, causal, dim**-0.5)
                        rg = kernels.MathKernel.backward(f[3], *f[:3], ro, rl, None, causal, dim**-0.5)
                        errors = [max_relative_error(o.float(), ro), max_relative_error(lse, rl)]
                        errors += [max_relative_error(a.float(), b) for a, b in zip(grads, rg, strict=True)]
                        worst = max(worst, max(errors))
                        if max(errors) > 3e-2:
                            print(variant, dtype, dim, heads, kv, causal, rate, [f"{e:.1e}" for e in errors])
    print(f"{variant}: worst relative error {worst:.2e}")
kernels._pad_head_dim = original
