"""Generation speed and memory of a `transformers` Llama: `sdpa` vs dilated attention, side by side.

    python3 benchmarks/transformers_generation.py [--lengths 5120 62464] [--new-tokens 32] [--rounds 5]

One small Llama (256 dims, 4 layers, 8 query heads, 4 key/value heads, float32,
random weights: memory and time do not depend on them) continues random prompts of
each length with ``model.generate`` (greedy) in four set-ups:

- ``sdpa``: PyTorch's attention, ``transformers``' default cache (it grows with the text);
- ``sdpa + static cache``: the same with ``cache_implementation="static"`` (keys and
  values preallocated for the whole generation: no copy of the cache per step);
- ``dilated``: ``w = [2048, 4096, 8192], r = [1, 2, 4]``, the default cache;
- ``dilated + DilatedCache``: the same, with the library's bounded cache (each layer
  keeps the last ``max(w) - 1 = 8191`` positions);
- ``no attention`` (timed only): the model with an attention function that reads
  nothing and returns zeros, and the static cache: what a token costs besides
  attention (projections, MLPs, norms, ``generate``'s own work), the same in every
  set-up (but for the attention mask, which ``transformers`` builds for ``sdpa`` and
  not for this function, and the cache's writes). Each set-up's time above it is what
  its attention and cache cost, which does not shrink with the model as the rest does.

The default prompts (5,120 and 62,464 tokens, about 4K and 64K) put the new tokens
where a dilated step costs about its mean over the cycle of segments: 5,120 positions
into the longest segment (mean 4,096), 1,024 into the others (mean 1,024 and 2,048).
At a multiple of every segment length (65,536) each branch's segment starts anew and a
step costs least: such a prompt would flatter dilated attention.

Memory: each set-up runs once in a fresh process, which reports the memory the
cache's keys and values hold on to when ``generate`` returns and the peak resident
memory ``generate`` adds over what the process held before it (see
:class:`dilated_attention.tools.benchmark.PeakMemory`), during the prefill (the
prompt's activations, the same for every set-up) and during the generation of the
new tokens after it (the cache and one step's temporaries).

Time (the prefill's and per new token): in another process, which measures no
memory (that makes glibc map every large block afresh for the rest of the process),
every set-up's ``generate`` runs ``--rounds`` times (once for prompts over
``--timed-up-to`` tokens), the set-ups taking turns (so that a slow spell of the
machine touches them alike); the median over the rounds.

Writes benchmarks/results/transformers-generation-cpu.json and .txt.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dilated_attention.tools.arguments import positive_int, positive_ints

HERE = os.path.dirname(os.path.abspath(__file__))
SETUPS = ("sdpa", "sdpa + static cache", "dilated", "dilated + DilatedCache")
FLOOR = "no attention"  # timed beside the set-ups, its memory not measured
BRANCHES = dict(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])


def build(setup: str, length: int):
    """The model of ``setup`` (the same weights for every set-up) and its random prompt."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from dilated_attention.integrations.transformers import register

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
    if setup == FLOOR:
        AttentionInterface.register("no_attention", no_attention)
        model.set_attn_implementation("no_attention")
    else:
        model.set_attn_implementation("sdpa" if setup.startswith("sdpa") else "dilated")
    return model, torch.randint(0, 256, (1, length))


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function that reads no key: zeros ``(B, Lq, H, D)`` (the floor)."""
    batch, heads, length, dim = query.shape
    return query.new_zeros(batch, length, heads, dim), None


def generate(setup: str, model, prompt: torch.Tensor, new_tokens: int, peak=None) -> dict:
    """One ``generate`` call: its cache, the prefill's seconds and peak added memory (with
    ``peak``, a running :class:`PeakMemory`), and the milliseconds per new token."""
    from transformers import StoppingCriteria

    from dilated_attention.integrations.transformers import DilatedCache

    times, prefill_peak = [], []

    class AfterEachToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if not times and peak is not None:  # the prefill is done: measure the decoding steps' peak from here
                prefill_peak.append(peak.restart())
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    # past_key_values=: the name every supported transformers version takes
    extra: dict = {}
    if setup.endswith("DilatedCache"):
        extra["past_key_values"] = DilatedCache(model)
    elif setup.endswith("static cache") or setup == FLOOR:
        extra["cache_implementation"] = "static"
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
    return {
        "cache": result.get("cache", None) or result.get("past_key_values", None),
        "prefill_s": times[0] - start,
        "prefill_peak_added_bytes": prefill_peak[0] if prefill_peak else None,
        "ms_per_new_token": 1000 * (times[-1] - times[0]) / (len(times) - 1),
    }


def measure(setup: str, length: int, new_tokens: int) -> dict:
    """One ``generate`` call in this process: its memory."""
    from dilated_attention.integrations.transformers import held_bytes
    from dilated_attention.tools.benchmark import PeakMemory

    model, prompt = build(setup, length)
    with torch.no_grad(), PeakMemory(torch.device("cpu")) as peak:
        run = generate(setup, model, prompt, new_tokens, peak)
    return {
        "setup": setup,
        "prompt_tokens": length,
        "new_tokens": new_tokens,
        "cache_bytes": held_bytes(run["cache"]),
        "prefill_peak_added_bytes": run["prefill_peak_added_bytes"],
        "decode_peak_added_bytes": peak.added,
    }


def timed_rounds(length: int, new_tokens: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """The prefill's seconds and the milliseconds per new token of every set-up,
    ``rounds`` times, the set-ups taking turns, after a warm-up on a short prompt."""
    models = {setup: build(setup, length) for setup in (*SETUPS, FLOOR)}
    times: dict[str, dict[str, list[float]]] = {setup: {"prefill_s": [], "ms_per_new_token": []} for setup in models}
    with torch.no_grad():
        for setup, (model, prompt) in models.items():  # warm-up, not recorded
            generate(setup, model, prompt[:, :64], 2)
        for _ in range(rounds):
            for setup, (model, prompt) in models.items():
                run = generate(setup, model, prompt, new_tokens)
                for key, series in times[setup].items():
                    series.append(run[key])
    return times


def table(rows: list[dict]) -> str:
    """The rows as a text table; ``x best sdpa``: time per token over the faster ``sdpa``
    set-up's at the same prompt length; ``above floor``: time per token over the
    ``no attention`` row's (what attention and cache add)."""
    header = f"{'setup':<24}{'prompt':>8}{'MiB':>8}{'prefill':>12}{'decode':>12}{'prefill s':>11}{'ms/token':>10}"
    lines = [f"{'':<32}{'cache':>8}{'peak added MiB':>24}", header + f"{'x best sdpa':>13}{'above floor':>13}"]
    for r in rows:
        keys = ("cache_bytes", "prefill_peak_added_bytes", "decode_peak_added_bytes")
        mib = "".join(
            f"{r[key] / 2**20:>{width}.1f}" if r.get(key) is not None else f"{'-':>{width}}"
            for key, width in zip(keys, (8, 12, 12), strict=True)
        )
        same = [o for o in rows if o["prompt_tokens"] == r["prompt_tokens"]]
        sdpa = [o["ms_per_new_token"] for o in same if o["setup"][:4] == "sdpa"]
        floor = [o["ms_per_new_token"] for o in same if o["setup"] == FLOOR]
        ratio = f"{r['ms_per_new_token'] / min(sdpa):>13.2f}" if sdpa and r["setup"] != FLOOR else f"{'':>13}"
        above = f"{r['ms_per_new_token'] - floor[0]:>13.1f}" if floor and r["setup"] != FLOOR else ""
        lines.append(
            f"{r['setup']:<24}{r['prompt_tokens']:>8}{mib}{r['prefill_s']:>11.2f}{r['ms_per_new_token']:>10.1f}{ratio}{above}".rstrip()
        )
    rounds = sorted({(len(r["ms_per_new_token_rounds"]), r["prompt_tokens"]) for r in rows})
    counts = ", ".join(f"{count} at {prompt}" for count, prompt in rounds)
    lines.append(
        f"prefill s, ms/token: the median of the rounds ({counts} tokens), the set-ups taking turns in a "
        "process that measures no memory; memory: one run per set-up in a fresh process; no attention: the model "
        "with an attention function that reads nothing (static cache), the floor every set-up pays; above floor: "
        "ms/token minus the floor's, what attention and cache add"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=positive_ints, nargs="+", default=[5120, 62464])
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--timed-up-to", type=positive_int, default=8192)
    parser.add_argument("--one", nargs=2, metavar=("SETUP", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds-of", type=int, metavar="LENGTH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.new_tokens)))
        return
    if args.rounds_of:
        print(json.dumps(timed_rounds(args.rounds_of, args.new_tokens, args.rounds)))
        return
    from dilated_attention.tools.benchmark import json_from, machine_info, machine_words
    from dilated_attention.utils.files import write_results

    rows = []
    for length in args.lengths:
        for setup in SETUPS:
            command = [sys.executable, __file__, "--one", setup, str(length), "--new-tokens", str(args.new_tokens)]
            rows.append(json_from(command, f"{setup} at {length}"))
        command = [sys.executable, __file__, "--rounds-of", str(length), "--new-tokens", str(args.new_tokens)]
        command += ["--rounds", str(args.rounds if length <= args.timed_up_to else 1)]
        rounds = json_from(command, f"the timed rounds at {length}")
        rows.append({"setup": FLOOR, "prompt_tokens": length, "new_tokens": args.new_tokens})
        for row in rows[-len(SETUPS) - 1 :]:
            row["ms_per_new_token_rounds"] = rounds[row["setup"]]["ms_per_new_token"]
            for key, series in rounds[row["setup"]].items():
                row[key] = statistics.median(series)
        print(table(rows[-len(SETUPS) - 1 :]), flush=True)
    import transformers

    payload = {
        "machine": machine_info(torch.device("cpu")),
        "dtype": "float32",
        "transformers": transformers.__version__,
        "branches": BRANCHES,
        "results": rows,
    }
    text = (
        f"transformers {transformers.__version__} generation, float32, {machine_words(payload['machine'])}, "
        f"{args.new_tokens} new tokens\n{table(rows)}"
    )
    print(text)
    write_results(os.path.join(HERE, "results", "transformers-generation-cpu"), payload, text)


if __name__ == "__main__":
    main()
