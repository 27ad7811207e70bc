"""Per-rank memory and bytes moved of sequence-parallel dilated attention, P = 1, 2, 4.

    python3 benchmarks/distributed.py [--seq-len 49152] [--nprocs 1 2 4] [-- extra example args]

Runs examples/distributed.py under torchrun (gloo, CPU) for each process count, at a
fixed sequence length, and collects every rank's figures into
benchmarks/results/distributed-cpu.json and a table (.txt beside it). On one
machine the processes share its cores, so the times say little; memory and bytes
are what this shows.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from dilated_attention.tools.arguments import positive_int, positive_ints
from dilated_attention.tools.benchmark import machine_info
from dilated_attention.utils.files import write_results

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "distributed.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=positive_int, default=49152)
    parser.add_argument("--nprocs", type=positive_ints, nargs="+", default=[1, 2, 4])
    parser.add_argument("extra", nargs="*", help="passed on to examples/distributed.py")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nprocs:
            out = os.path.join(tmp, f"{nproc}.json")
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                EXAMPLE,
                "--seq-len",
                str(args.seq_len),
                "--no-check",
                "--json",
                out,
                *args.extra,
            ]
            print("+", " ".join(command[1:]), flush=True)
            subprocess.run(command, check=True)
            with open(out) as f:
                runs.append({"nproc": nproc, **json.load(f)})
    machine = machine_info(torch.device("cpu"))
    lines = [
        (
            f"{machine['cpu']}, torch {machine['torch']}, gloo; "
            f"N={args.seq_len}, {runs[0]['args']['dtype']}, {runs[0]['args']['mode']}, "
            f"w={runs[0]['args']['segment_lengths']} r={runs[0]['args']['dilation_rates']}, "
            f"H={runs[0]['args']['heads']} D={runs[0]['args']['head_dim']}; per rank (max over ranks):"
        ),
        (
            f"{'P':>2} {'shard':>7} {'q,k,v MiB':>10} {'fwd+bwd peak added MiB':>23} {'fwd sent MiB':>13} "
            f"{'fwd recv MiB':>13} {'bwd sent MiB':>13} {'bwd recv MiB':>13}"
        ),
    ]
    for run in runs:
        ranks = run["ranks"]
        top = {
            key: max(r[key] for r in ranks) / 2**20
            for key in (
                "input_bytes",
                "peak_added_bytes",
                "forward_sent",
                "forward_received",
                "backward_sent",
                "backward_received",
            )
        }
        lines.append(
            f"{run['nproc']:>2} {max(r['shard'] for r in ranks):>7} {top['input_bytes']:>10.1f} "
            f"{top['peak_added_bytes']:>23.1f} {top['forward_sent']:>13.2f} {top['forward_received']:>13.2f} "
            f"{top['backward_sent']:>13.2f} {top['backward_received']:>13.2f}"
        )
    print("\n".join(lines))
    stem = os.path.join(HERE, "results", "distributed-cpu")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    write_results(stem, {"machine": machine, "runs": runs}, "\n".join(lines))
    print(f"wrote {stem}.json and {stem}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
