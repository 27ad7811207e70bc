"""Which kernels run a call: the engine's block kernels (PyTorch's fused attention ops
on strided views, :mod:`dilated_attention.ops.kernels`) or the fused Triton kernels
(:mod:`dilated_attention.ops.triton_kernels`), which run every branch of a call in one
launch.

The choice, per call: the ``kernel`` argument of
:func:`dilated_attention.dilated_attention`, else the environment variable
``DILATED_ATTENTION_KERNEL``, else ``"auto"``:

- ``"auto"``: the Triton kernels on CUDA for float16 and bfloat16 inputs with head
  dims 16 to 256, at most 65,535 batch rows and heads, without dropout and on one
  process, when Triton is importable and the call is not being compiled or captured;
  PyTorch's kernels for everything else;
- ``"triton"``: the Triton kernels, or a ``ValueError`` saying why they cannot run
  this call (never a silent fallback). They also take float32 (exact dots, no TF32)
  and any head dim up to 256; on the CPU they run in Triton's interpreter, which
  needs ``TRITON_INTERPRET=1`` in the environment before Triton is imported (for tests;
  ``import dilated_attention`` imports it, through torch's compiler);
- ``"torch"``: PyTorch's kernels.

The caches (:mod:`dilated_attention.nn.cache`) take the same choice for their steps
of a few query rows, with one difference under ``"auto"``: on CUDA their fused decode
launches (:mod:`dilated_attention.ops.ring_decode`) also run float32 and head dims
below 16 (up to 256), as they form scores without ``tl.dot`` (no tiles, no TF32).

Nothing here imports Triton until a call asks for the Triton kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .validation import check_choice

KERNEL_ENV = "DILATED_ATTENTION_KERNEL"
CHOICES = ("auto", "triton", "torch")
# Head dims the Triton kernels take (a tile's head dim is a power of two >= 16).
MAX_HEAD_DIM = 256
AUTO_MIN_HEAD_DIM = 16
AUTO_DTYPES = (torch.float16, torch.bfloat16)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Batch rows and heads a launch takes at most: its grid's y and z extents (CUDA's limit).
MAX_GRID_YZ = 65535


def requested(kernel: str | None) -> str:
    """``kernel``, else ``$DILATED_ATTENTION_KERNEL``, else ``"auto"``, checked."""
    source = "kernel"
    if kernel is None:
        kernel, source = os.environ.get(KERNEL_ENV) or "auto", KERNEL_ENV
    meaning = " ('auto': Triton where it applies, 'triton': the fused Triton kernels, 'torch': PyTorch's kernels)"
    return check_choice(kernel, source, CHOICES, meaning)


def why_not_triton(q: torch.Tensor, dropout: float, distributed: bool, capturable: bool = False) -> str | None:
    """Why the Triton kernels cannot run a call on ``q`` ``(B, L, H, D)``, or ``None``.
    ``capturable``: the call's launches take the same arguments at every step (the
    static cache's), so a CUDA graph may capture them."""
    if dropout > 0:
        return "dropout is not fused (its masks are the library's position-keyed ones): use dropout_p=0"
    if torch.compiler.is_compiling():
        return "under torch.compile the calls run PyTorch's operations, which it compiles"
    if not capturable and q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "under CUDA graph capture the engine runs PyTorch's kernels"
    if distributed:
        return "process_group calls are not fused (the engine exchanges rows between the ranks)"
    if q.dtype not in TRITON_DTYPES:
        return f"{q.dtype} is not fused (float16, bfloat16 and float32 are)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above {MAX_HEAD_DIM}"
    if not capturable and (q.shape[0] > MAX_GRID_YZ or q.shape[2] > MAX_GRID_YZ):  # caches' launches: one axis
        return (
            f"a launch takes at most {MAX_GRID_YZ} batch rows and {MAX_GRID_YZ} heads (CUDA's grid limit), "
            f"got {q.shape[0]} and {q.shape[2]}: split the batch"
        )
    if not _triton_installed():
        return "Triton is not installed (it comes with PyTorch's CUDA builds; pip install triton)"
    if q.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return (
                "on the CPU they run only in Triton's interpreter: set TRITON_INTERPRET=1 in the environment "
                "before Triton is imported (best: before Python starts)"
            )
        if not _interpreter_in_effect():
            return (
                "TRITON_INTERPRET=1 was set after Triton was imported (import dilated_attention imports it, "
                "through torch.compile's modules), so Triton's own functions were made for a GPU: set it in the "
                "environment before Python starts"
            )
        return None
    if q.device.type != "cuda":
        return f"Triton has no backend for {q.device.type} tensors here"
    return None


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreter_in_effect() -> bool:
    """Whether Triton's own jit functions (``tl.max``) were made for its interpreter:
    Triton chooses it for each function when the function is defined, so
    ``TRITON_INTERPRET=1`` set after Triton was imported does not take. ``True`` where
    Triton's internals are not as this test knows them."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return True
    made = getattr(tl, "max", None)
    return not isinstance(made, JITFunction) or isinstance(made, InterpretedFunction)


def refusal(kernel: str | None, what: str, reason: str) -> ValueError:
    """The error for the Triton kernels asked for, by ``kernel="triton"`` or (``kernel``
    ``None``) by the environment, where they cannot run ``what`` for ``reason``."""
    given = "kernel='triton'" if kernel is not None else f"{KERNEL_ENV}=triton"
    return ValueError(f"{given} cannot run {what}: {reason}; or use kernel='auto' or 'torch'")


def use_triton(q: torch.Tensor, dropout: float, distributed: bool, kernel: str | None) -> bool:
    """Whether a call on ``q`` runs the Triton kernels (see the module docstring); a
    ``ValueError`` for ``kernel="triton"`` where they cannot."""
    choice = requested(kernel)
    if choice == "torch" or (choice == "auto" and q.device.type != "cuda"):
        return False
    reason = why_not_triton(q, dropout, distributed)
    if choice == "triton":
        if reason is not None:
            raise refusal(kernel, "this call", reason)
        return True
    return reason is None and q.device.type == "cuda" and q.dtype in AUTO_DTYPES and q.shape[-1] >= AUTO_MIN_HEAD_DIM


def describe(q: torch.Tensor, dropout: float = 0.0, distributed: bool = False, kernel: str | None = None) -> str:
    """Which kernels a call on ``q`` runs, in words (what ``dilated-attention check``
    reports)."""
    if use_triton(q, dropout, distributed, kernel):
        where = " in Triton's interpreter" if q.device.type == "cpu" else ""
        return f"triton (the fused kernels: every branch in one launch{where})"
    from .kernels import select_kernel

    return f"torch ({select_kernel(q.device, q.dtype, dropout).__name__} on each block of the plan)"


def kernels():
    """The Triton kernel module (imported on first use)."""
    from . import triton_kernels

    return triton_kernels
