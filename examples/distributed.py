"""Sequence-parallel dilated attention: each process holds a shard of the sequence.

    torchrun --nproc_per_node 4 examples/distributed.py                   # CPU, gloo
    torchrun --nproc_per_node 8 examples/distributed.py --backend nccl   # one GPU per process

Every rank runs a forward and backward on its shard and rank 0 prints each rank's
time, the peak memory its step added and the bytes it moved. Then, unless --no-check,
every rank compares its shard of the output and of the gradients with the
single-process result on the whole sequence (which this check, and only it, computes
on every rank), and rank 0 ends with a line "PASS: ..." or "FAIL: ..." naming the
worst error over all ranks and the tolerance (dilated_attention.tools.check's
ONE_PROCESS_TOLERANCES for the dtype). The exit status is 1 on FAIL.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from dilated_attention import dilated_attention
from dilated_attention.ops.distributed import Communicator
from dilated_attention.tools.benchmark import PeakMemory
from dilated_attention.tools.check import ONE_PROCESS_TOLERANCES, max_relative_error
from dilated_attention.utils.files import atomic_write


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384, help="whole sequence length N (default: 16384)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default: 1)")
    parser.add_argument("--heads", type=int, default=8, help="number of heads H (default: 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="size D of each head (default: 64)")
    parser.add_argument(
        "--segment-lengths",
        type=int,
        nargs="+",
        default=[2048, 4096, 8192],
        help="segment length w of each branch (default: 2048 4096 8192)",
    )
    parser.add_argument(
        "--dilation-rates",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="dilation rate r of each branch (default: 1 2 4)",
    )
    parser.add_argument(
        "--mode",
        choices=("mixture", "head_groups"),
        default="mixture",
        help="how the branches share the heads (default: mixture)",
    )
    parser.add_argument(
        "--causal", action="store_true", help="queries attend only to keys at or before them (default: off)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64", "bfloat16", "float16"),
        default="float32",
        help="dtype of q, k, v (default: float32)",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="nccl" if torch.cuda.is_available() else "gloo",
        help="torch.distributed backend; nccl puts each process on its own GPU "
        "(default: nccl where CUDA is available, else gloo)",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="skip the comparison with one process (default: off, so the check runs)"
    )
    parser.add_argument("--json", help="rank 0 writes every rank's figures to this file (default: none)")
    return parser.parse_args()


def shard_lengths(seq_len: int, world: int) -> list[int]:
    """Near-equal contiguous shards; the first ``seq_len % world`` one longer."""
    base, extra = divmod(seq_len, world)
    return [base + (1 if rank < extra else 0) for rank in range(world)]


def verdict(table: list[dict], dtype: torch.dtype, check: bool) -> tuple[bool, str]:
    """``(passed, final line)`` from every rank's figures: the worst output or gradient
    error against the tolerance of ``dtype`` (or a pass without a check)."""
    if not check:
        return True, "PASS: ran without the comparison with one process (--no-check)"
    worst = max(max(f["out_error"], f["grad_error"]) for f in table)
    tolerance = ONE_PROCESS_TOLERANCES[dtype]
    passed = worst <= tolerance
    relation = "<=" if passed else ">"
    return passed, (
        f"{'PASS' if passed else 'FAIL'}: worst error {worst:.2g} {relation} tolerance {tolerance:g} "
        f"({str(dtype).removeprefix('torch.')}, every rank against one process)"
    )


def main():
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(  # exit status 1, the message on stderr
            "error: examples/distributed.py runs one process per rank: launch it with torchrun, e.g. "
            "torchrun --nproc_per_node 2 examples/distributed.py [options] "
            "(or python3 -m torch.distributed.run --nproc_per_node 2 examples/distributed.py [options])"
        )
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.seq_len < world:
        dist.destroy_process_group()
        raise SystemExit(f"error: --seq-len {args.seq_len} leaves a rank no row: at least one per process ({world})")
    dtype = getattr(torch, args.dtype)
    lengths = shard_lengths(args.seq_len, world)
    lo = sum(lengths[:rank])
    hi = lo + lengths[rank]
    attention = dict(mode=args.mode, is_causal=args.causal)

    # The same full inputs on every rank (for the check); each keeps only its shard.
    gen = torch.Generator().manual_seed(0)
    full_shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    full = [torch.randn(full_shape, generator=gen).to(dtype) for _ in range(4)]
    q, k, v, grad = (t[:, lo:hi].to(device).clone() for t in full)
    if args.no_check:
        del full
    for t in (q, k, v):
        t.requires_grad_()

    communicator = Communicator(dist.group.WORLD)  # records what each call moves

    def step():
        out = dilated_attention(
            q, k, v, args.segment_lengths, args.dilation_rates, process_group=communicator, **attention
        )
        return out, torch.autograd.grad(out, (q, k, v), grad)

    step()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    # Memory in a step of its own, after the timed one: PeakMemory leaves glibc mapping
    # every large block afresh, which would slow a step timed inside it.
    dist.barrier()
    with PeakMemory(device) as peak:
        out, grads = step()
    figures = dict(
        rank=rank,
        shard=lengths[rank],
        ms=1e3 * seconds,
        peak_added_bytes=peak.added,
        input_bytes=3 * q.numel() * q.element_size(),
        **vars(communicator.traffic),
    )
    if not args.no_check:
        ref_inputs = [t.to(device).requires_grad_() for t in full[:3]]
        ref = dilated_attention(*ref_inputs, args.segment_lengths, args.dilation_rates, **attention)
        ref_grads = torch.autograd.grad(ref, ref_inputs, full[3].to(device))
        figures["out_error"] = max_relative_error(out, ref[:, lo:hi])
        figures["grad_error"] = max_relative_error(grads, [g[:, lo:hi] for g in ref_grads])

    table = [None] * world
    dist.all_gather_object(table, figures)
    passed, line = verdict(table, dtype, check=not args.no_check)
    if rank == 0:
        print(
            f"N={args.seq_len} over {world} processes ({args.backend}), {args.dtype}, {args.mode}"
            f"{', causal' if args.causal else ''}, w={args.segment_lengths} r={args.dilation_rates}, "
            f"B={args.batch} H={args.heads} D={args.head_dim}"
        )
        print(
            f"{'rank':>4} {'shard':>7} {'fwd+bwd ms':>11} {'inputs MiB':>10} {'peak+ MiB':>10} "
            f"{'fwd sent B':>10} {'fwd recv B':>10} {'bwd sent B':>10} {'bwd recv B':>10} "
            f"{'out err':>9} {'grad err':>9}"
        )
        for f in table:
            print(
                f"{f['rank']:>4} {f['shard']:>7} {f['ms']:>11.1f} {f['input_bytes'] / 2**20:>10.1f} "
                f"{f['peak_added_bytes'] / 2**20:>10.1f} {f['forward_sent']:>10} {f['forward_received']:>10} "
                f"{f['backward_sent']:>10} {f['backward_received']:>10} "
                f"{f.get('out_error', float('nan')):>9.1e} {f.get('grad_error', float('nan')):>9.1e}"
            )
        if args.json:
            with atomic_write(args.json) as fh:
                json.dump({"args": vars(args), "ranks": table}, fh, indent=1)
        print(line)
    dist.destroy_process_group()
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
