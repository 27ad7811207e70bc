"""Checks of user input. Each failure names the argument and says how to fix it."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

from .plan import HEAD_OFFSETS, MODES, uncached_when_compiling, window_start_needed

# The dtypes the library computes in, by name (as the command line spells them).
FLOAT_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES.values())

# The largest position a key may have (positions are int64, with room to spare).
MAX_POSITION = 2**62

# Seeds are ints in [0, SEED_LIMIT): what every torch generator accepts.
SEED_LIMIT = 2**63

# Tensor layouts the functional API accepts: ours, and PyTorch SDPA's.
LAYOUTS = {"bnhd": "(batch, seq_len, heads, head_dim)", "bhnd": "(batch, heads, seq_len, head_dim)"}


@contextlib.contextmanager
def shared_errors(process_group):
    """A layer's own input checks, before its collective calls: with a ``process_group``
    a ``ValueError`` or ``TypeError`` raised inside is raised on every rank of it
    (:func:`dilated_attention.ops.distributed.raise_everywhere`), where the other ranks
    would otherwise wait in their next collective call for this one."""
    try:
        yield
    except (ValueError, TypeError) as error:
        if process_group is None:
            raise
        from .distributed import raise_everywhere

        raise_everywhere(process_group, error)


def shown_number(value) -> str:
    """``value`` for an error message; an int of more than 30 digits by its size (its
    digits may be too many to print)."""
    if isinstance(value, numbers.Integral) and abs(int(value)).bit_length() > 100:
        return f"an int of {int(value).bit_length()} bits"
    return str(value)


def type_name(value) -> str:
    """``int``, ``numpy.bool_``, ``torch.Tensor``: a type name a user recognises."""
    cls = type(value)
    module = cls.__module__.split(".")[0]
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def counted(number: int, noun: str) -> str:
    """``1 value``, ``2 values``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def check_branches(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate the ``(w_i, r_i)`` lists and return them as tuples of ints."""
    plain = (list, tuple)
    if type(segment_lengths) in plain and type(dilation_rates) in plain:
        both = (*segment_lengths, *dilation_rates)
        if all(type(value) is int for value in both):  # as most calls give them: checked once
            return uncached_when_compiling(_checked_int_branches)(tuple(segment_lengths), tuple(dilation_rates))
    return _check_branches(segment_lengths, dilation_rates)


@functools.lru_cache(maxsize=256)
def _checked_int_branches(segment_lengths: tuple[int, ...], dilation_rates: tuple[int, ...]):
    return _check_branches(segment_lengths, dilation_rates)


def _check_branches(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lists = {}
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a list or tuple of positive ints, got {type_name(values)}")
        if len(values) == 0:
            raise ValueError(f"{name} must not be empty: give at least one branch")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must contain ints, got {value!r} ({type_name(value)})")
            if value < 1:
                raise ValueError(f"{name} must contain values >= 1, got {value}")
        # operator.index: plain ints, which torch.compile specialises on (it would trace
        # a length that changed between calls as a symbol the planner cannot take)
        lists[name] = tuple(operator.index(value) for value in values)
    if len(lists["segment_lengths"]) != len(lists["dilation_rates"]):
        raise ValueError(
            f"segment_lengths ({counted(len(segment_lengths), 'value')}) and dilation_rates "
            f"({counted(len(dilation_rates), 'value')}) must have the same length: one (w, r) pair per branch"
        )
    return lists["segment_lengths"], lists["dilation_rates"]


def check_choice(value, name: str, choices, meaning: str = "") -> str:
    """``value`` as a plain str if it is one of the strings ``choices`` (a str subclass,
    NumPy's included, becomes a str, which ``torch.compile`` takes as a constant); else a
    ``TypeError`` (not a str) or a ``ValueError`` (another str) naming ``name``, the
    choices and their ``meaning``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {tuple(choices)} (a str), got {type_name(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}{meaning}, got {value!r}")
    return str.__str__(value)


def check_mode(mode) -> str:
    return check_choice(mode, "mode", MODES)


def check_layout(layout) -> str:
    return check_choice(
        layout,
        "layout",
        LAYOUTS,
        f" ('bnhd' for {LAYOUTS['bnhd']}, 'bhnd' for {LAYOUTS['bhnd']}, the layout of "
        "torch.nn.functional.scaled_dot_product_attention)",
    )


def check_head_offsets(head_offsets) -> str:
    return check_choice(
        head_offsets,
        "head_offsets",
        HEAD_OFFSETS,
        " ('interleaved': head j uses offset j % r, the paper's; 'contiguous': runs of ceil(H / r) heads, "
        "torchscale's)",
    )


def check_dropout(dropout_p, name: str = "dropout_p") -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type_name(dropout_p)}")
    try:
        value = float(dropout_p)
    except OverflowError:  # an int beyond float's range
        value = math.inf
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {shown_number(dropout_p)}")
    return value


def constant_float(value) -> float:
    """``float(value)`` as a constant also where ``torch.compile(dynamic=True)`` traces
    float arguments as symbols: the round trip through ``float.hex`` makes it read the
    value (a guard), so checks on it and the kernels see a number, not a symbol."""
    return float.fromhex(float(value).hex())


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type_name(softmax_scale)}")
    try:
        scale = constant_float(softmax_scale)
    except OverflowError:
        scale = math.inf
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {shown_number(softmax_scale)}")
    return scale


FLOAT32_MAX = torch.finfo(torch.float32).max


def kernel_scale(scale: float, dtype: torch.dtype) -> float:
    """``scale`` as the kernels use it for inputs of ``dtype``: they compute scores of
    float32, float16 and bfloat16 inputs in float32, so it is rounded to float32
    (a tiny scale becomes 0, which the kernels must know); one too large for float32
    is refused, as is one whose product with ``log2(e)`` (the Triton kernels' base-2
    scores) is."""
    scale = constant_float(scale)  # a symbol again after a graph break under torch.compile(dynamic=True)
    if dtype == torch.float64:
        return scale
    try:
        rounded = struct.unpack("f", struct.pack("f", scale))[0]
    except OverflowError:
        rounded = math.inf
    if math.isinf(rounded) or abs(rounded) * math.log2(math.e) > FLOAT32_MAX:
        raise ValueError(
            f"softmax_scale={scale} does not fit float32, in which the scores of {dtype} inputs "
            "are computed: use a smaller scale (fold the rest into q) or float64 inputs"
        )
    return rounded


TORCH_FUNC_REFUSAL = (
    "dilated_attention does not support torch.func transforms (grad, vjp, vmap, ...), nor batched gradients "
    "(torch.autograd.functional.jacobian(vectorize=True), torch.autograd.grad(is_grads_batched=True)): use "
    "torch.autograd.grad or .backward() for gradients, jacobian with vectorize=False, and a batch dimension (or a "
    "loop) instead of vmap"
)

FORWARD_AD_REFUSAL = (
    "dilated_attention has no forward-mode AD (torch.autograd.forward_ad), and its inputs carry tangents: use "
    "reverse mode (torch.autograd.grad, .backward(), torch.autograd.functional.jacobian with vectorize=False)"
)


def refuse_torch_func(*tensors: torch.Tensor) -> None:
    """A ``RuntimeError`` under a ``torch.func`` transform (``vmap``, ``grad``, ...), or
    where one of ``tensors`` carries a forward-mode tangent, raised before any work: the
    library reads tensor values to plan and to skip work, which a transform cannot
    follow, and its fused kernels have no forward-mode derivative. ``torch.compile`` is
    not refused."""
    if torch.compiler.is_compiling():
        return
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(TORCH_FUNC_REFUSAL)
    # -1 outside torch.autograd.forward_ad.dual_level(): one int read on every call
    if getattr(forward_ad, "_current_level", 0) >= 0 and any(
        isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):  # a non-tensor is refused by the checks that follow, by name
        raise RuntimeError(FORWARD_AD_REFUSAL)


def gradients_are_batched(*grads: torch.Tensor | None) -> bool:
    """Whether a backward runs under ``vmap``: ``torch.func`` (e.g. ``jacrev``), or the
    older batching of ``torch.autograd.grad(is_grads_batched=True)`` and ``jacobian(
    vectorize=True)``, whose gradients are batched tensors of their own kind."""
    if torch.compiler.is_compiling():  # tracing a backward: the transforms of the trace, under grad mode only
        return torch.is_grad_enabled() and torch._C._are_functorch_transforms_active()
    if torch._C._are_functorch_transforms_active():
        return True
    legacy = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    return legacy is not None and any(g is not None and legacy(g) for g in grads)


def check_flag(value, name: str) -> bool:
    """A Python or NumPy bool."""
    if isinstance(value, bool):
        return value
    if type_name(value) == "numpy.bool_" or type_name(value) == "numpy.bool":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({type_name(value)})")


# The dtypes autocast casts (float64 it leaves alone).
_AUTOCAST_CAST = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``device_type``; ``None`` outside it
    (and on devices without autocast, such as ``meta``)."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_inputs(*tensors):
    """``tensors`` as SDPA takes them under ``torch.autocast`` on their device: float32,
    float16 and bfloat16 tensors cast to the autocast dtype (float64 and anything else
    as they are); unchanged outside autocast."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return tensors
    dtype = autocast_dtype(first.device.type)
    if dtype is None:
        return tensors
    floats = [t.dtype for t in tensors if isinstance(t, torch.Tensor)]
    if torch.float64 in floats and any(d in _AUTOCAST_CAST for d in floats):
        raise ValueError(
            f"q, k and v are {', '.join(str(d) for d in floats)}: under torch.autocast the float64 ones stay "
            f"float64 and the others become {dtype}; cast them to one dtype"
        )
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CAST and t.dtype != dtype else t
        for t in tensors
    )


def check_saved_config(module, saved: dict, mine: dict) -> None:
    """A ``ValueError`` if a checkpoint's configuration (``saved``, a module's extra
    state) differs from the ``module``'s own (``mine``)."""
    for name, value in mine.items():
        if name not in saved or saved[name] != value:
            raise ValueError(
                f"cannot load a state_dict saved from a {type(module).__name__} with {name}="
                f"{saved.get(name, 'missing')!r} into one with {name}={value!r}: build the module "
                "with the checkpoint's configuration"
            )


def check_tensor(t, name: str) -> None:
    """``t`` (called ``name``): a tensor, and not a nested one."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
    if t.is_nested:
        raise ValueError(
            f"{name} must be a dense tensor, got a nested tensor: pad the sequences to one length and pass "
            "key_padding_mask (an nn.TransformerEncoder built around nn.MultiheadAttention makes nested tensors "
            "in eval mode: set its use_nested_tensor = False, nn.Transformer's encoder's included, or build it "
            "after replacing self_attn)"
        )


def check_qkv(q, k, v, layout: str = "bnhd") -> None:
    """``q, k, v``: 4-D tensors in ``layout`` of one dtype and device; ``k`` and ``v``
    of one shape, ``q`` of theirs but for its length (checked by the caller) and its
    heads, a multiple of theirs (grouped-query attention)."""
    dims = LAYOUTS[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name)
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {dims} (layout={layout!r}), got shape {tuple(t.shape)}")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense tensor, got layout {t.layout}: use {name}.to_dense()")
        if t.dtype not in _FLOAT_DTYPE_SET:
            raise ValueError(f"{name} must be float64, float32, bfloat16 or float16, got {t.dtype}")
        if 0 in t.shape:
            raise ValueError(f"{name} must have every dim >= 1, got shape {tuple(t.shape)} {dims}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)} {dims}")
    if (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]):
        raise ValueError(
            f"k must have the batch size and head_dim of q {tuple(q.shape)}, got {tuple(k.shape)} {dims}: "
            "dilated attention is self-attention over one sequence"
        )
    heads = 1 if layout == "bhnd" else 2
    check_key_heads(int(q.shape[heads]), int(k.shape[heads]))
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}: cast it")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}: move it")


def check_key_heads(num_heads: int, kv_heads: int) -> None:
    """Grouped-query attention: the key/value heads ``H_kv`` divide the query heads ``H``."""
    if num_heads % kv_heads:
        divisors = ", ".join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0)
        raise ValueError(
            f"k and v have {kv_heads} heads and q {num_heads}: grouped-query attention needs the key/value heads "
            f"H_kv to divide the query heads H (each key/value head serves H / H_kv query heads); give k and v "
            f"one of {divisors} heads"
        )


def check_int(value, name: str, least: int, below: int | None = None) -> int:
    """An int ``>= least`` (and ``< below``, if given), not a bool: else a ``TypeError``
    (not an int) or a ``ValueError`` (out of range)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    number = int(value)
    if number < least or (below is not None and number >= below):
        bound = f">= {least}" if below is None else f"in [{least}, {_power_of_two(below)})"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return number


def _power_of_two(value: int) -> str:
    """``2**63`` for a large power of two, else the number."""
    return f"2**{value.bit_length() - 1}" if value > 2**16 and value & (value - 1) == 0 else str(value)


def check_positive_int(value, name: str) -> int:
    """An int ``>= 1`` (not a bool)."""
    return check_int(value, name, 1)


def check_non_negative_int(value, name: str) -> int:
    """An int ``>= 0`` (not a bool)."""
    return check_int(value, name, 0)


def check_number(
    value,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    meaning: str = "",
) -> float:
    """A finite real number (not a bool) from ``low`` to ``high``, each end included
    unless open, as a float: else a ``TypeError`` (not a number) or a ``ValueError``
    (out of range or not finite); ``meaning`` is added to the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type_name(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = -math.inf if value < 0 else math.inf
    above_low = number > low if low_open else number >= low
    below_high = number < high if high_open else number <= high
    if not (math.isfinite(number) and above_low and below_high):
        raise ValueError(
            f"{name} must be a finite number {_interval(low, high, low_open, high_open)}{meaning}, got {value!r}"
        )
    return number


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """``> 0``, ``<= 1``, ``in (0, 1]``: the range as a message says it."""
    if math.isinf(high):
        return f"{'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_per_row_ints(value, name: str, batch: int) -> tuple[int, ...]:
    """An int, or a ``(batch,)`` integer tensor: one int per batch row."""
    if isinstance(value, torch.Tensor):
        if value.shape != (batch,) or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(
                f"{name} must be an int or an integer tensor of shape (batch,) = ({batch},), got "
                f"{value.dtype} of shape {tuple(value.shape)}"
            )
        if value.is_meta:
            raise ValueError(f"{name} is a tensor on the meta device, which holds no values: pass it on a real device")
        return tuple(int(a) for a in value.tolist())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or a (batch,) integer tensor, got {type_name(value)}")
    return (operator.index(value),) * batch  # operator.index: torch.compile specialises on it


def check_positions(value, name: str, batch: int, least: int, meaning: str) -> tuple[int, ...]:
    """``value`` as :func:`check_per_row_ints` reads it, each in ``[least, MAX_POSITION]``
    (``meaning`` says why ``least``)."""
    positions = check_per_row_ints(value, name, batch)
    if min(positions) < least:
        bound = "-2**62" if least == -MAX_POSITION else least
        raise ValueError(f"{name} must be >= {bound} ({meaning}), got {min(positions)}")
    if max(positions) > MAX_POSITION:
        raise ValueError(f"{name} must be at most 2**62 (positions are int64), got {max(positions)}")
    return positions


def check_key_offset(key_offset, batch: int) -> tuple[int, ...]:
    """``key_offset``: an int ``>= 0``, or a ``(B,)`` integer tensor of them; one per
    batch row."""
    return check_positions(key_offset, "key_offset", batch, 0, "the position of k's first row")


def check_window(key_offset: int, num_queries: int, num_keys: int, segment_lengths, is_causal: bool) -> None:
    """The keys must reach back to the start of the segment of the first query, in
    every branch (see :func:`dilated_attention.ops.plan.window_start_needed`)."""
    first_query = key_offset + num_keys - num_queries
    needed = window_start_needed(first_query, segment_lengths)
    if key_offset > needed:
        fix = (
            f"pass k and v from position {needed} on (the max(segment_lengths) - 1 positions before the first "
            "query always suffice)"
            if is_causal
            else f"without is_causal the queries are the keys' rows, so they must start a segment of every "
            f"branch (key_offset a multiple of every segment length): pass q, k and v from position {needed} on"
        )
        raise ValueError(
            f"the keys start at position key_offset={key_offset}, but the first query (position "
            f"{first_query}) attends to keys from position {needed}, where its segment starts: {fix}"
        )


def check_padding_mask(mask, batch: int, seq_len: int, device) -> torch.Tensor | None:
    """``key_padding_mask``: ``None`` or a bool ``(B, N)`` tensor, ``True`` = padding."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type_name(mask)}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be a bool tensor (True = padding), got {mask.dtype}: "
            "use mask.bool() or mask == 0 as appropriate"
        )
    if tuple(mask.shape) != (batch, seq_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_len of k) = {(batch, seq_len)}, got {tuple(mask.shape)}"
        )
    _check_mask_device(mask, "key_padding_mask", device)
    return mask


def _require(ok: torch.Tensor, message: str) -> None:
    """A ``ValueError`` with ``message`` unless ``ok`` (a 0-dim bool tensor) is true.
    Under ``torch.compile``, where a value cannot be read without breaking the graph,
    the check is part of the graph and fails at run time with a ``RuntimeError`` (on
    CUDA, a device-side assertion) carrying the same message."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def _check_mask_device(mask: torch.Tensor, name: str, device) -> None:
    if mask.device != device:
        raise ValueError(f"{name} must be on the device of the query ({device}), got {mask.device}")


def bool_padding_mask(mask, device):
    """``key_padding_mask`` as ``nn.MultiheadAttention`` takes it, made bool: a float
    mask of ``0`` (key kept) and ``-inf`` (padding), as PyTorch's transformer layers
    pass it, becomes ``mask == -inf`` (other values are refused, see :func:`_require`);
    any other mask is returned as it is (for :func:`check_padding_mask`)."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return mask
    _check_mask_device(mask, "key_padding_mask", device)
    padding = torch.isneginf(mask)
    _require(
        (padding | (mask == 0)).all(),
        "key_padding_mask must be bool (True = padding) or a float mask of 0 and -inf as "
        "torch.nn.MultiheadAttention takes it, got other values: dilated attention adds no bias to the scores",
    )
    return padding


def causal_from_attn_mask(attn_mask, is_causal, seq_len: int, device, layout: str = "") -> bool:
    """``is_causal`` given ``nn.MultiheadAttention``'s ``attn_mask``: ``None``, or the
    causal mask of ``seq_len`` rows (bool, ``True`` above the diagonal, or float, ``-inf``
    there and ``0`` elsewhere, as ``nn.Transformer.generate_square_subsequent_mask``
    makes it), which makes the call causal. With ``is_causal=True`` the mask is
    PyTorch's hint: its shape and dtype are checked, not its values (as
    ``nn.MultiheadAttention`` takes it, at no cost); without, its values are (see
    :func:`_require`). ``layout``: how the query was read, for the shape's message."""
    is_causal = check_flag(is_causal, "is_causal")
    if attn_mask is None:
        return is_causal
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type_name(attn_mask)}")
    refusal = (
        f"attn_mask must be None or the causal mask of the sequence, ({seq_len}, {seq_len}) with True (bool) or "
        "-inf (float) above the diagonal and False or 0 elsewhere, as nn.Transformer.generate_square_subsequent_mask "
        "makes it: the keys each query sees are set by segment_lengths and dilation_rates, so no other mask "
        "applies (pass is_causal=True for causal attention, key_padding_mask for padding)"
    )
    if tuple(attn_mask.shape) != (seq_len, seq_len) or not (
        attn_mask.dtype == torch.bool or attn_mask.is_floating_point()
    ):
        raise ValueError(f"{refusal}; got a {attn_mask.dtype} mask of shape {tuple(attn_mask.shape)}{layout}")
    _check_mask_device(attn_mask, "attn_mask", device)
    if not is_causal:
        rows = torch.arange(seq_len, device=device)
        above = rows[None, :] > rows[:, None]
        causal = above if attn_mask.dtype == torch.bool else torch.where(above, -math.inf, 0.0).to(attn_mask.dtype)
        _require((attn_mask == causal).all(), f"{refusal}; got another ({seq_len}, {seq_len}) mask")
    return True


def check_head_groups(
    num_heads: int, num_branches: int, fix: str = "use more heads, fewer branches, or mode='mixture'"
) -> None:
    """A ``ValueError`` (saying ``fix``) unless ``head_groups`` has a head per branch."""
    if num_heads < num_branches:
        raise ValueError(
            f"mode='head_groups' needs at least one head per branch: {num_heads} heads < {num_branches} branches; {fix}"
        )


@dataclass(frozen=True, kw_only=True)
class Attention:
    """A validated call. ``q`` ``(B, Lq, H, D)``, ``k, v`` ``(B, Lk, H_kv, D)`` (``H_kv``
    divides ``H``), ``padding``
    ``(B, Lk)`` bool or ``None``; ``key_offsets``: the position of ``k``'s first row,
    per batch row (the queries are the last ``Lq`` positions)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    padding: torch.Tensor | None
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str
    head_offsets: str
    is_causal: bool
    scale: float
    key_offsets: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, Lq, H, D)`` as Python ints. (``operator.index`` also makes
        ``torch.compile`` specialise on them: the plan depends on every size.)"""
        batch, length, heads, dim = (operator.index(size) for size in self.q.shape)
        return batch, length, heads, dim

    @property
    def num_keys(self) -> int:
        return operator.index(self.k.shape[1])


def check_attention(
    q,
    k,
    v,
    segment_lengths,
    dilation_rates,
    mode,
    is_causal,
    softmax_scale,
    key_padding_mask,
    layout="bnhd",
    head_offsets="interleaved",
    key_offset=0,
) -> Attention:
    """Validate what the library and the reference share; ``q, k, v`` come back as
    ``(B, L, H, D)`` views whatever ``layout`` they arrived in."""
    layout = check_layout(layout)
    check_qkv(q, k, v, layout)
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    mode = check_mode(mode)
    head_offsets = check_head_offsets(head_offsets)
    is_causal = check_flag(is_causal, "is_causal")
    batch, num_queries, num_heads, head_dim = (operator.index(size) for size in q.shape)
    num_keys = operator.index(k.shape[1])
    if num_queries > num_keys:
        raise ValueError(
            f"q has {num_queries} positions but k and v only {num_keys}: the queries must be among the "
            "keys' positions (pass the keys of every query)"
        )
    if num_queries != num_keys and not is_causal:
        raise ValueError(
            f"q has {num_queries} positions and k, v {num_keys}: queries at the end of a longer key "
            "window need is_causal=True (without it a query would see later keys that are not given)"
        )
    if mode == "head_groups":
        check_head_groups(num_heads, len(segment_lengths))
    key_offsets = check_key_offset(key_offset, batch)
    for offset in sorted(set(key_offsets)):
        check_window(offset, num_queries, num_keys, segment_lengths, is_causal)
    scale = check_scale(softmax_scale, head_dim)
    kernel_scale(scale, q.dtype)  # refused here, before a caller draws a dropout seed, where float32 cannot hold it
    return Attention(
        q=q,
        k=k,
        v=v,
        padding=check_padding_mask(key_padding_mask, batch, num_keys, q.device),
        segment_lengths=segment_lengths,
        dilation_rates=dilation_rates,
        mode=mode,
        head_offsets=head_offsets,
        is_causal=is_causal,
        scale=scale,
        key_offsets=key_offsets,
    )
