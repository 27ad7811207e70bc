"""Compile the fused Triton kernels for NVIDIA GPUs on a machine without one, and
report each variant's registers, spills and shared memory.

Triton's wheels bundle ``ptxas``, so ``triton.compile`` turns a kernel into a cubin
for any architecture without a driver: this checks that every variant the library
launches compiles for the GPUs it targets (a kernel can run in the interpreter and
still fail to compile), and gives the resource numbers that bound the block sizes
before a GPU is at hand. Run it without ``TRITON_INTERPRET`` set:

    python3 benchmarks/triton_compile.py --capability 80 90 --out benchmarks/results/triton-compile.json

Exit status 1 if a variant fails to compile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dilated_attention.ops import ring_decode as rd
from dilated_attention.ops import triton_kernels as tk
from dilated_attention.ops.fused import MAX_HEAD_DIM
from dilated_attention.tools.arguments import number, positive_ints
from dilated_attention.utils.files import atomic_write, check_output_file

# Pointer arguments by name: their element type (the input dtype for "{dtype}").
POINTERS = {
    "Q": "{dtype}",
    "K": "{dtype}",
    "V": "{dtype}",
    "OUT": "{dtype}",
    "DQ": "{dtype}",
    "DO": "{dtype}",
    "DK": "{dtype}",
    "DV": "{dtype}",
    "PAD": "u8",
    "LSE": "fp32",
    "DELTA": "fp32",
    "DLSE": "fp32",
    "KEY_START": "i64",
    "SEG": "i64",
    "RATE": "i64",
    "OFFSET": "i32",
}
# The caches' decode kernels (ring_decode): their own pointers, offsets as int64.
RING_POINTERS = {
    **POINTERS,
    "NEW_K": "{dtype}",
    "NEW_V": "{dtype}",
    "NEXT": "i64",
    "KEY_POS": "i64",
    "BAD": "u8",
    "OFFSET": "i64",
    "PART_M": "fp32",
    "PART_L": "fp32",
    "PART_O": "fp32",
    "PART_FLAGS": "i32",
}
FLOATS = {"scale_log2", "scale", "out_scale"}
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def signature(kernel, dtype: str, constexprs: dict) -> dict:
    """Triton's signature of ``kernel``: pointer and scalar types, ``constexpr`` for
    the compile-time arguments."""
    pointers = RING_POINTERS if kernel in (rd._append_kernel, rd._ring_kernel, rd._combine_kernel) else POINTERS
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in pointers:
            types[name] = "*" + pointers[name].format(dtype=dtype)
        else:
            types[name] = "fp32" if name in FLOATS else "i32"
    return types


def variants(head_dims, dtypes, all_configs: bool = False, quick: bool = False):
    """``(name, kernel, dtype, constexprs, num_warps, num_stages)`` of every kernel and
    tile configuration the library's autotuner may launch on a GPU, and of the
    caches' decode kernels, per head dim and dtype (``quick``: causal engine calls
    without padding or checks only)."""
    flag_sets = [(True, False, False)] if quick else list(itertools.product((False, True), repeat=3))
    for head_dim, dtype, (causal, padding, check) in itertools.product(head_dims, dtypes, flag_sets):
        dim_block = max(16, triton.next_power_of_2(head_dim))
        flags = dict(
            DIM_BLOCK=dim_block,
            DIM_MASK=dim_block != head_dim,
            CAUSAL=causal,
            HAS_PADDING=padding,
            CHECK_FINITE=check,
            DOT_FP32=False,
            PRECISION="ieee" if dtype == "fp32" else "tf32",
        )
        tag = (
            f"D{head_dim}-{dtype}-{'causal' if causal else 'full'}"
            f"{'-pad' if padding else ''}{'-check' if check else ''}"
        )
        passes = [
            ("forward", "forward", tk._forward_kernel, dict(BACKWARD=False)),
            ("dq", "dq", tk._forward_kernel, dict(BACKWARD=True)),
            ("dkdv", "keys", tk._key_grads_kernel, {}),
            ("decode", "decode", tk._forward_kernel, dict(BACKWARD=False)),
        ]
        for name, kind, kernel, extra in passes:
            configs = tk.gpu_configs(kind, dim_block)
            for block_m, block_n, warps, stages in configs if all_configs else configs[:1]:
                constexprs = dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, **extra)
                yield f"{name}-{tag}-{block_m}x{block_n}w{warps}s{stages}", kernel, dtype, constexprs, warps, stages
    for head_dim, dtype in itertools.product(head_dims, dtypes):
        dim_block = max(16, triton.next_power_of_2(head_dim))
        constexprs = dict(DIM_BLOCK=dim_block, BLOCK=16, HAS_DLSE=True)
        yield f"delta-D{head_dim}-{dtype}", tk._delta_kernel, dtype, constexprs, 4, 1
        # the caches' decode step, with Triton's default warps and stages (as launched)
        yield f"ring-append-D{head_dim}-{dtype}", rd._append_kernel, dtype, dict(DIM_BLOCK=dim_block), 4, 3
        for consecutive in (False, True):
            constexprs = dict(BLOCK=rd.key_block(dim_block), DIM_BLOCK=dim_block, CONSECUTIVE=consecutive)
            name = f"ring-{'window' if consecutive else 'ring'}-D{head_dim}-{dtype}"
            yield name, rd._ring_kernel, dtype, constexprs, 4, 3
        constexprs = dict(SPLIT_BLOCK=rd.MAX_SPLITS, DIM_BLOCK=dim_block)
        yield f"ring-combine-D{head_dim}-{dtype}", rd._combine_kernel, dtype, constexprs, 4, 3


def resources(cubin: bytes) -> dict:
    """Registers, local memory (spills) and shared memory of a cubin, read by the
    ``cuobjdump`` that ships with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {
        "registers": int(found.get("REG", -1)),
        "stack_bytes": int(found.get("STACK", 0)),
        "local_bytes": int(found.get("LOCAL", 0)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--capability",
        type=number(int, 80, several=True),
        nargs="+",
        default=[80, 90],
        help="compute capabilities to compile for, 80 (Ampere, whose bfloat16 tiles the kernels use) and up "
        "(default: 80 90)",
    )
    parser.add_argument(
        "--head-dims",
        type=positive_ints,
        nargs="+",
        default=[64, 128],
        help=f"head dims to compile, 1 to {MAX_HEAD_DIM} (default: 64 128)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16"], help="input dtypes (default: bfloat16)"
    )
    parser.add_argument(
        "--all-configs",
        action="store_true",
        help="every tile configuration the autotuner tries (default: the first of each pass)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="causal calls without padding or non-finite checks only (default: every flag set)",
    )
    parser.add_argument("--out", help="JSON file to write the results to (default: none)")
    args = parser.parse_args(argv)
    if max(args.head_dims) > MAX_HEAD_DIM:
        parser.error(f"--head-dims must be at most {MAX_HEAD_DIM} (the kernels' limit), got {max(args.head_dims)}")
    if args.out:
        try:
            check_output_file(args.out, "--out", "triton-compile.json")
        except ValueError as exc:
            parser.error(str(exc))
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: the interpreter's kernels do not compile", file=sys.stderr)
        return 2
    rows, failures = [], 0
    for capability in args.capability:
        for name, kernel, dtype, constexprs, warps, stages in variants(
            args.head_dims, [DTYPES[d] for d in args.dtypes], args.all_configs, args.quick
        ):
            started = time.perf_counter()
            try:
                compiled = triton.compile(
                    ASTSource(kernel, signature(kernel, dtype, constexprs), constexprs=constexprs),
                    target=GPUTarget("cuda", capability, 32),
                    options={"num_warps": warps, "num_stages": stages},
                )
                row = {
                    "variant": name,
                    "sm": capability,
                    **resources(compiled.asm["cubin"]),
                    "shared_bytes": compiled.metadata.shared,
                    "seconds": round(time.perf_counter() - started, 2),
                }
            except Exception as exc:  # noqa: BLE001 - report every failing variant, then fail
                failures += 1
                row = {"variant": name, "sm": capability, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with atomic_write(args.out) as f:
            json.dump({"triton": triton.__version__, "variants": rows}, f, indent=1)
    print(f"{len(rows) - failures} of {len(rows)} variants compiled (Triton {triton.__version__})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
