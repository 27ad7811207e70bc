import os

import torch

# Without a GPU the fused Triton kernels run in Triton's interpreter on the CPU, which
# Triton picks when it is imported: before anything (transformers, torch.compile)
# imports it. With one, the CUDA tests run them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
