"""Where the CPU engine's time goes beside PyTorch's fused kernel, each measured alone.

    python3 benchmarks/cpu_costs.py [--threads 2] [--repeats 9]

Config (the issue's): float32, B=1, H=8, D=64, N=32768, segment_lengths=[2048, 4096,
8192], dilation_rates=[1, 2, 4]. Every comparison runs its two sides alternately in
one process, the median of each side's times:

- fresh memory: a ``torch.full`` of the output's size on memory glibc maps afresh,
  against a ``fill_`` of an existing tensor (the page faults of first touch);
- PyTorch's op on the kernel calls of a ``head_groups`` forward as the engine makes
  them (strided views of the dilated rows) against the same calls on contiguous
  copies, and the kernel's own contiguous batch of the first branch (per segment and
  head of ``2048 x 2048`` rows);
- a forward of each mode with the packing of long queries' inputs
  (``ops.kernels._packed_inputs``) against one without it;
- a forward and backward of each mode in kernel calls of at most ``2^20`` output
  elements (``functional.MAX_CALL_ELEMENTS``, the engine's) against ``2^22``;
- a ``head_groups`` forward before and after a ``PeakMemory`` measurement in the same
  process (its glibc settings last for the rest of a process), in a fresh process;
- PyTorch's huge-page allocation (``THP_MEM_ALLOC_ENABLE=1``: blocks of 2 MiB and more
  advised to the kernel as huge pages, which back their 2 MiB-aligned parts where
  ``/sys/kernel/mm/transparent_hugepage/enabled`` allows it): fresh processes with and
  without it, taking turns, each timing a fresh output, a forward of each mode and the
  ``head_groups`` forward against the kernel alone, alternating.

Writes benchmarks/results/cpu-costs-cpu-float32-<machine>.json and .txt.
"""

import argparse
import json
import os
import statistics
import sys

import torch

from dilated_attention import dilated_attention, functional
from dilated_attention.ops import kernels
from dilated_attention.tools import benchmark
from dilated_attention.tools.arguments import positive_int, threads
from dilated_attention.utils.files import write_results

HERE = os.path.dirname(os.path.abspath(__file__))
N, H, D = 32768, 8, 64
SEGMENTS, RATES = [2048, 4096, 8192], [1, 2, 4]
CPU = torch.device("cpu")


def alternating(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and of ``second()``, run alternately after one
    warm-up of each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        times[0].append(benchmark._seconds(first, CPU))
        times[1].append(benchmark._seconds(second, CPU))
    return statistics.median(times[0]), statistics.median(times[1])


def inputs():
    return [torch.randn(1, N, H, D) for _ in range(3)]


def forward(mode: str, q, k, v):
    return lambda: dilated_attention(q, k, v, SEGMENTS, RATES, mode=mode)


def fresh_memory(repeats: int) -> dict:
    existing = torch.empty(1, N, H, D)
    fresh, reused = alternating(lambda: torch.full((1, N, H, D), 0.0), lambda: existing.fill_(0.0), repeats)
    return {"mib": existing.numel() * 4 / 2**20, "fresh_ms": 1e3 * fresh, "existing_ms": 1e3 * reused}


def kernel_calls(repeats: int) -> dict:
    """PyTorch's op on each kernel call of a head_groups forward: on the views the
    engine makes and on contiguous copies."""
    calls = []
    made = kernels.CpuFlashKernel.forward

    def record(q, k, v, bias, is_causal, scale, dropout=None):
        calls.append((q, k, v, is_causal, scale))
        return made(q, k, v, bias, is_causal, scale, dropout)

    q, k, v = inputs()
    kernels.CpuFlashKernel.forward = staticmethod(record)
    try:
        with torch.no_grad():
            forward("head_groups", q, k, v)()
    finally:
        kernels.CpuFlashKernel.forward = staticmethod(made)
    op = kernels._aten._scaled_dot_product_flash_attention_for_cpu
    distinct = {(tuple(c[0].shape), c[0].stride()): c for c in calls}  # calls alike but for their rows
    rows = []
    with torch.no_grad():
        for cq, ck, cv, is_causal, scale in distinct.values():
            packed = [t.contiguous() for t in (cq, ck, cv)]
            as_made, contiguous = alternating(
                lambda views=(cq, ck, cv), is_causal=is_causal, scale=scale: op(*views, 0.0, is_causal, scale=scale),
                lambda packed=packed, is_causal=is_causal, scale=scale: op(*packed, 0.0, is_causal, scale=scale),
                repeats,
            )
            units = cq.shape[0] * cq.shape[1] * cq.shape[2] * ck.shape[2] / 2048**2
            rows.append(
                {
                    "shape": list(cq.shape),
                    "query_row_stride": cq.stride(2),
                    "views_ms": 1e3 * as_made,
                    "contiguous_ms": 1e3 * contiguous,
                    "units": units,
                }
            )
        cfg = benchmark.BenchConfig(seq_lens=[N])
        (kq, kk, kv, _), kernel, _, _ = benchmark._workload("kernel", N, cfg)
        own = statistics.median(benchmark._seconds(lambda: kernel(kq, kk, kv), CPU) for _ in range(repeats))
    own_units = kq.shape[0] * kq.shape[1] * kq.shape[2] ** 2 / 2048**2
    return {"calls": rows, "kernel_batch": list(kq.shape), "kernel_ms_per_unit": 1e3 * own / own_units}


def packing(repeats: int) -> dict:
    packed_inputs = kernels._packed_inputs
    q, k, v = inputs()
    found = {}
    with torch.no_grad():
        for mode in ("head_groups", "mixture"):
            call = forward(mode, q, k, v)

            def unpacked(call=call):
                kernels._packed_inputs = lambda q, k, v: (q, k, v)
                try:
                    call()
                finally:
                    kernels._packed_inputs = packed_inputs

            with_packing, without = alternating(call, unpacked, repeats)
            found[mode] = {"packed_ms": 1e3 * with_packing, "unpacked_ms": 1e3 * without}
    return found


def call_sizes(repeats: int, sizes=(2**20, 2**22)) -> dict:
    """A forward and backward of each mode with kernel calls of at most ``sizes``
    output elements (``functional.MAX_CALL_ELEMENTS``), alternating: ms by size."""
    budget = dict(functional.MAX_CALL_ELEMENTS)
    q, k, v = (t.requires_grad_() for t in inputs())
    grad = torch.randn_like(q)
    found = {}
    for mode in ("head_groups", "mixture"):
        call = forward(mode, q, k, v)

        def sized(elements: int, call=call):
            functional.MAX_CALL_ELEMENTS["cpu"] = elements
            try:
                torch.autograd.grad(call(), (q, k, v), grad)
            finally:
                functional.MAX_CALL_ELEMENTS.update(budget)

        times = alternating(lambda: sized(sizes[0]), lambda: sized(sizes[1]), repeats)
        found[mode] = {str(size): 1e3 * t for size, t in zip(sizes, times, strict=True)}
    return found


def in_fresh_process(body: str, what: str, env: dict[str, str] | None = None):
    """The JSON that ``body`` prints, run in a fresh process (environment ``env``)
    after it imports this module as ``c``, takes this one's thread count and makes
    ``q, k, v``."""
    code = (
        "import json, statistics, sys, torch\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "import cpu_costs as c\n"
        f"torch.set_num_threads({torch.get_num_threads()})\n"
        "q, k, v = c.inputs()\n"
    )
    return benchmark.json_from([sys.executable, "-c", code + body], what, env=env)


def after_peak_memory(repeats: int) -> dict:
    """In a fresh process: head_groups forwards before and after one PeakMemory."""
    body = (
        "call = c.forward('head_groups', q, k, v)\n"
        "with torch.no_grad():\n"
        "    call()\n"
        f"    before = [c.benchmark._seconds(call, c.CPU) for _ in range({repeats})]\n"
        "    with c.benchmark.PeakMemory(c.CPU):\n"
        "        call()\n"
        f"    after = [c.benchmark._seconds(call, c.CPU) for _ in range({repeats})]\n"
        "print(json.dumps({'before_ms': 1e3 * statistics.median(before), 'after_ms': 1e3 * statistics.median(after)}))"
    )
    return in_fresh_process(body, "the PeakMemory measurement")


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def huge_pages(repeats: int, rounds: int) -> dict:
    """Fresh processes with and without ``THP_MEM_ALLOC_ENABLE=1``, taking turns
    ``rounds`` times: per setting, the median over its processes of each process's
    median fresh ``torch.full`` of the output, forwards of both modes, and
    ``head_groups`` forward GFLOP/s over the kernel's alone (alternating in-process)."""
    body = (
        "found = {}\n"
        "with torch.no_grad():\n"
        "    calls = {'fresh_ms': lambda: torch.full(q.shape, 0.0),\n"
        "             'head_groups_ms': c.forward('head_groups', q, k, v),\n"
        "             'mixture_ms': c.forward('mixture', q, k, v)}\n"
        "    for name, call in calls.items():\n"
        "        call()\n"
        f"        found[name] = 1e3 * statistics.median(c.benchmark._seconds(call, c.CPU) for _ in range({repeats}))\n"
        f"cfg = c.benchmark.BenchConfig(seq_lens=[c.N], repeats={repeats})\n"
        "found['head_groups_over_kernel'] = c.benchmark.kernel_fraction('head_groups', c.N, cfg, False)\n"
        "print(json.dumps(found))"
    )
    settings = {"default": "0", "huge_pages": "1"}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, value in settings.items():
            env = {**os.environ, HUGE_PAGES_ENV: value}
            runs[name].append(in_fresh_process(body, f"the {name} process", env))
    return {
        name: {key: statistics.median(run[key] for run in found) for key in found[0]} for name, found in runs.items()
    }


def transparent_huge_pages() -> str:
    """The kernel's THP mode (the bracketed word of its setting), or why it is unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
    except OSError:
        return "unknown (no /sys/kernel/mm/transparent_hugepage/enabled)"
    return setting[setting.find("[") + 1 : setting.find("]")] if "[" in setting else setting.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=threads, default=2, help="torch.set_num_threads (default: 2)")
    parser.add_argument("--repeats", type=positive_int, default=9, help="runs of each side (default: 9)")
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="processes of each huge-page setting, taking turns (default: 3)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = benchmark.machine_info(CPU)
    lines = [
        (
            f"CPU costs beside the fused kernel: {benchmark.machine_words(machine)}, float32, B=1 H={H} D={D}, "
            f"N={N}, segment_lengths={SEGMENTS} dilation_rates={RATES}; medians of {args.repeats} runs of each "
            "side, alternating"
        )
    ]

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    print(lines[0], flush=True)
    memory = fresh_memory(args.repeats)
    say(
        f"\nfill of the output ({memory['mib']:.0f} MiB): fresh torch.full {memory['fresh_ms']:.1f} ms, "
        f"fill_ of an existing tensor {memory['existing_ms']:.1f} ms"
    )
    calls = kernel_calls(args.repeats)
    say("\nhead_groups kernel calls, PyTorch's op alone: on the strided views the engine makes and on")
    say("contiguous copies (each kind of call once); ms per (segment, head) of 2048 x 2048 rows in brackets")
    for row in calls["calls"]:
        units = row["units"]
        say(
            f"  q {tuple(row['shape'])}, query rows {row['query_row_stride']} apart: {row['views_ms']:.1f} ms "
            f"({row['views_ms'] / units:.2f}), contiguous {row['contiguous_ms']:.1f} ms "
            f"({row['contiguous_ms'] / units:.2f})"
        )
    say(f"  the kernel's own contiguous batch {tuple(calls['kernel_batch'])}: ({calls['kernel_ms_per_unit']:.2f})")
    packed = packing(args.repeats)
    say("\nforward with long queries' inputs packed, and without the packing:")
    for mode, row in packed.items():
        say(
            f"  {mode:12} packed {row['packed_ms']:.0f} ms, unpacked {row['unpacked_ms']:.0f} ms "
            f"(unpacked / packed {row['unpacked_ms'] / row['packed_ms']:.3f})"
        )
    sizes = call_sizes(args.repeats)
    say("\nforward and backward with kernel calls of at most 2^20 and 2^22 output elements (the engine's: 2^20):")
    for mode, row in sizes.items():
        small, large = row[str(2**20)], row[str(2**22)]
        say(f"  {mode:12} 2^20 {small:.0f} ms, 2^22 {large:.0f} ms (2^22 / 2^20 {large / small:.3f})")
    peak = after_peak_memory(args.repeats)
    say(
        f"\nhead_groups forward in a fresh process: {peak['before_ms']:.0f} ms, after one PeakMemory "
        f"{peak['after_ms']:.0f} ms (x{peak['after_ms'] / peak['before_ms']:.3f})"
    )
    thp_mode = transparent_huge_pages()
    pages = huge_pages(args.repeats, args.rounds)
    say(
        f"\n{HUGE_PAGES_ENV}=1 (PyTorch's huge-page allocation; the kernel's THP mode: {thp_mode}) and the "
        f"default,\n{args.rounds} fresh processes of each taking turns, the median of theirs:"
    )
    labels = {
        "fresh_ms": "fresh torch.full of the output, ms",
        "head_groups_ms": "head_groups forward, ms",
        "mixture_ms": "mixture forward, ms",
        "head_groups_over_kernel": "head_groups forward GFLOP/s / the kernel's",
    }
    say(f"  {'':46}{'default':>10}{'huge pages':>12}")
    for key, label in labels.items():
        digits = 3 if key == "head_groups_over_kernel" else 1
        say(f"  {label:46}{pages['default'][key]:>10.{digits}f}{pages['huge_pages'][key]:>12.{digits}f}")
    slug = benchmark.machine_slug(CPU)
    stem = os.path.join(HERE, "results", f"cpu-costs-cpu-float32-{slug}")
    payload = {
        "machine": machine,
        "dtype": "float32",
        "command": " ".join(sys.argv),
        "fresh_memory": memory,
        "kernel_calls": calls,
        "packing": packed,
        "call_sizes": sizes,
        "peak_memory": peak,
        "huge_pages": {"thp_mode": thp_mode, "rounds": args.rounds, **pages},
    }
    write_results(stem, json.loads(json.dumps(payload)), "\n".join(lines))
    print(f"wrote {stem}.json and {stem}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
