"""A small end-to-end example: the function, both modules, a training step, and a
comparison with the float64 reference. Runs on the CPU in a few seconds."""

import torch

from dilated_attention import (
    DilatedAttention,
    MultiheadDilatedAttention,
    dilated_attention,
    reference_dilated_attention,
)

torch.manual_seed(0)
segment_lengths, dilation_rates = [256, 512, 1024], [1, 2, 4]

# 1. The function on (batch, seq_len, heads, head_dim) tensors.
q, k, v = (torch.randn(2, 1500, 8, 32) for _ in range(3))  # 1500: not a multiple of any w
out, lse = dilated_attention(q, k, v, segment_lengths, dilation_rates, is_causal=True, return_lse=True)
print(f"dilated_attention: out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")

# 2. The same against the dense float64 reference (on a shorter sequence: it is O(N^2)).
small = [t[:, :300].double() for t in (q, k, v)]
fast = dilated_attention(*small, [64, 128], [1, 2], is_causal=True)
ref, _ = reference_dilated_attention(*small, [64, 128], [1, 2], is_causal=True)
print(f"max |fast - reference| in float64: {(fast - ref).abs().max().item():.2e}")

# 3. The parameter-free module, with a key padding mask (True = padding).
attention = DilatedAttention(segment_lengths, dilation_rates, mode="head_groups")
padding = torch.zeros(2, 1500, dtype=torch.bool)
padding[1, 1200:] = True
print(f"DilatedAttention(head_groups): {tuple(attention(q, k, v, key_padding_mask=padding).shape)}")

# 4. The multi-head module, batch first, and one training step.
mha = MultiheadDilatedAttention(256, 8, segment_lengths, dilation_rates, dropout=0.1)
optimizer = torch.optim.AdamW(mha.parameters(), lr=1e-3)
x = torch.randn(2, 1500, 256)
y, _ = mha(x, is_causal=True)
loss = y.square().mean()
loss.backward()
optimizer.step()
print(f"MultiheadDilatedAttention: output {tuple(y.shape)}, loss {loss.item():.4f}, one AdamW step done")
