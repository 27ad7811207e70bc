"""The operator: validation, the plan (which query rows meet which key rows), the engine
that runs a plan through a kernel and merges branches by their log-sum-exp, the kernels
(PyTorch's fused attention, the fused Triton kernels), the lean decode step, dropout
masks and the exchange between processes."""
