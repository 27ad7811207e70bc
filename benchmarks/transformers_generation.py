"""Generation memory of a `transformers` Llama: `sdpa` vs dilated attention, side by side.

    python3 benchmarks/transformers_generation.py [--lengths 4096 65536] [--new-tokens 32]

One small Llama (256 dims, 4 layers, 8 query heads, 4 key/value heads, float32,
random weights: memory and time do not depend on them) continues random prompts of
each length with ``model.generate`` (greedy) in three set-ups:

- ``sdpa``: PyTorch's attention, ``transformers``' default cache (it grows with the text);
- ``dilated``: ``w = [2048, 4096, 8192], r = [1, 2, 4]``, the default cache;
- ``dilated + DilatedCache``: the same, with the library's bounded cache (each layer
  keeps the last ``max(w) - 1 = 8191`` positions).

Each run is a fresh process. Reported: the memory the cache's keys and values hold
on to when ``generate`` returns; the peak resident memory ``generate`` adds over what the
process held before it (see :class:`dilated_attention.tools.benchmark.PeakMemory`), during
the prefill (the prompt's activations, the same for every set-up) and during the
generation of the new tokens after it (the cache and one step's temporaries); the
prefill time and the time per new token.

Writes benchmarks/results/transformers-generation-cpu.json and .txt.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SETUPS = ("sdpa", "dilated", "dilated + DilatedCache")
BRANCHES = dict(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])


def measure(setup: str, length: int, new_tokens: int) -> dict:
    """One ``generate`` call in this process."""
    from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria

    from dilated_attention.integrations.transformers import DilatedCache, held_bytes, register
    from dilated_attention.tools.benchmark import PeakMemory

    register("dilated", **BRANCHES)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2 * length,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa" if setup == "sdpa" else "dilated")
    prompt = torch.randint(0, 256, (1, length))
    cache = DilatedCache(model) if setup.endswith("DilatedCache") else None
    times, prefill_peak = [], []

    class AfterEachToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if not times:  # the prefill is done: measure the decoding steps' peak from here
                prefill_peak.append(peak.restart())
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    # past_key_values=: the name every supported transformers version takes
    extra = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad(), PeakMemory(torch.device("cpu")) as peak:
        start = time.perf_counter()
        result = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            stopping_criteria=[AfterEachToken()],
            **extra,
        )
    held = result.get("cache", None) or result.get("past_key_values", None)
    cache_bytes = held_bytes(held)
    return {
        "setup": setup,
        "prompt_tokens": length,
        "new_tokens": new_tokens,
        "cache_bytes": cache_bytes,
        "prefill_peak_added_bytes": prefill_peak[0],
        "decode_peak_added_bytes": peak.added,
        "prefill_s": times[0] - start,
        "ms_per_new_token": 1000 * (times[-1] - times[0]) / (len(times) - 1),
    }


def table(rows: list[dict]) -> str:
    lines = [
        f"{'':<32}{'cache':>8}{'peak added MiB':>24}",
        f"{'setup':<24}{'prompt':>8}{'MiB':>8}{'prefill':>12}{'decode':>12}{'prefill s':>11}{'ms/token':>10}",
    ]
    for r in rows:
        mib = [r[key] / 2**20 for key in ("cache_bytes", "prefill_peak_added_bytes", "decode_peak_added_bytes")]
        lines.append(
            f"{r['setup']:<24}{r['prompt_tokens']:>8}{mib[0]:>8.1f}{mib[1]:>12.1f}{mib[2]:>12.1f}"
            f"{r['prefill_s']:>11.2f}{r['ms_per_new_token']:>10.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--one", nargs=2, metavar=("SETUP", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.new_tokens)))
        return
    from dilated_attention.tools.benchmark import machine_info
    from dilated_attention.utils.files import write_results

    rows = []
    for length in args.lengths:
        for setup in SETUPS:
            command = [sys.executable, __file__, "--one", setup, str(length), "--new-tokens", str(args.new_tokens)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    import transformers

    payload = {
        "machine": machine_info(torch.device("cpu")),
        "transformers": transformers.__version__,
        "branches": BRANCHES,
        "results": rows,
    }
    text = table(rows)
    print(text)
    write_results(os.path.join(HERE, "results", "transformers-generation-cpu"), payload, text)


if __name__ == "__main__":
    main()
