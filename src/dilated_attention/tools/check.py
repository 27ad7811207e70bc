"""Compare the library with the float64 reference on a battery of configurations.

Errors are *relative to the reference's largest magnitude*:
``max|x - ref| / max(max|ref|, 1e-3)`` for the output, the same over the three
gradients together (a gradient can be exactly 0, such as ``dq`` when every query
has one key, and must not be judged by rounding noise relative to itself), and
``max|lse - ref| / max(1, max|ref|)`` for the LSE on its finite entries (an LSE of
``-inf`` where the reference has a finite one, or the reverse, is an infinite error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..functional import dilated_attention
from ..reference import reference_dilated_attention

# Relative tolerances per dtype against the float64 reference; low precision is
# limited by its rounding of inputs held in the kernels, not by the algorithm.
TOLERANCES = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}

# Relative tolerances of a sequence-parallel result against the one-process result
# in the same dtype (docs/definition.md: fp64 1e-12, fp32 1e-5; low precision as above).
ONE_PROCESS_TOLERANCES = {**TOLERANCES, torch.float64: 1e-12, torch.float32: 1e-5}


def max_relative_error(x, ref) -> float:
    """``max|x - ref| / max(max|ref|, 1e-3)`` in float64; ``x`` and ``ref`` are tensors
    or equally long sequences of tensors (then the maxima run over all of them).

    Non-finite values must match exactly (NaN where ``ref`` has NaN, the same
    infinities); any other difference in them is an infinite error."""
    xs = [x] if isinstance(x, torch.Tensor) else list(x)
    refs = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    err = top = 0.0
    for a, b in zip(xs, refs, strict=True):
        a, b = a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()
        finite = torch.isfinite(b)
        if not torch.equal(torch.isnan(a), torch.isnan(b)) or not torch.equal(a[torch.isinf(b)], b[torch.isinf(b)]):
            return math.inf
        if not torch.isfinite(a[finite]).all():
            return math.inf
        if finite.any():
            err = max(err, (a[finite] - b[finite]).abs().max().item())
            top = max(top, b[finite].abs().max().item())
    return err / max(top, 1e-3)


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Error on finite entries relative to ``max(1, max|ref|)``; ``inf`` if the
    non-finite entries (``-inf``, NaN) differ."""
    lse, ref = lse.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    other = ~torch.isfinite(ref)
    same_pattern = torch.equal(torch.isfinite(lse), ~other)
    if not same_pattern or not torch.equal(lse[other].nan_to_num(), ref[other].nan_to_num()):
        return math.inf
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    scale = max(1.0, ref[finite].abs().max().item())
    return (lse[finite] - ref[finite]).abs().max().item() / scale


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str = "mixture"
    is_causal: bool = False
    masked: bool = False


def default_cases() -> list[Case]:
    """Both modes, causal or not, masked or not, on aligned, odd and tiny shapes."""
    shapes = [
        ("aligned", 2, 64, 4, 16, (16, 32), (1, 2)),
        ("odd", 2, 61, 5, 16, (8, 25, 100), (1, 3, 5)),  # w > N, w % r != 0, short tail
        ("tiny", 1, 3, 3, 16, (4, 2), (2, 1)),
    ]
    return [
        Case(name, b, n, h, d, w, r, mode, causal, masked)
        for name, b, n, h, d, w, r in shapes
        for mode in ("mixture", "head_groups")
        for causal in (False, True)
        for masked in (False, True)
    ]


@dataclass
class CaseResult:
    case: Case
    out_error: float
    lse_error: float
    grad_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return max(self.out_error, self.lse_error, self.grad_error) <= self.tolerance


def run_case(
    case: Case, device, dtype, generator: torch.Generator | None = None, kernel: str | None = None
) -> CaseResult:
    """Draw random inputs, run library (``kernel``: see :mod:`dilated_attention.ops.fused`)
    and reference, compare output, LSE and the gradients of ``q, k, v`` for a random
    output gradient."""
    shape = (case.batch, case.seq_len, case.heads, case.head_dim)

    def draw(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64).to(device)

    q, k, v = (draw(*shape).to(dtype).requires_grad_() for _ in range(3))
    grad = draw(*shape).to(dtype)
    mask = None
    if case.masked:
        mask = (torch.rand(case.batch, case.seq_len, generator=generator) < 0.3).to(device)
    branches = (case.segment_lengths, case.dilation_rates)
    out, lse = dilated_attention(
        q,
        k,
        v,
        *branches,
        mode=case.mode,
        is_causal=case.is_causal,
        key_padding_mask=mask,
        return_lse=True,
        kernel=kernel,
    )
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_inputs = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    rq, rk, rv = ref_inputs
    ref_out, ref_lse = reference_dilated_attention(
        rq, rk, rv, *branches, mode=case.mode, is_causal=case.is_causal, key_padding_mask=mask
    )
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad.to(torch.float64))
    return CaseResult(
        case,
        out_error=max_relative_error(out, ref_out),
        lse_error=lse_error(lse, ref_lse),
        grad_error=max_relative_error(grads, ref_grads),
        tolerance=TOLERANCES[dtype],
    )


def format_table(results: list[CaseResult]) -> str:
    header = (
        f"{'case':8} {'mode':11} {'causal':6} {'mask':5} {'B':>2} {'N':>4} {'H':>2} "
        f"{'out err':>9} {'lse err':>9} {'grad err':>9} {'tol':>8}  ok"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c = r.case
        lines.append(
            f"{c.name:8} {c.mode:11} {c.is_causal!s:6} {c.masked!s:5} {c.batch:>2} "
            f"{c.seq_len:>4} {c.heads:>2} {r.out_error:9.2e} {r.lse_error:9.2e} "
            f"{r.grad_error:9.2e} {r.tolerance:8.0e}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)
