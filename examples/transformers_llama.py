"""A small Llama from `transformers`, switched to dilated attention in one line, trained
for a few steps on the library's default corpus (the standard library's sources, as
bytes) and asked to continue a prompt. Runs on the CPU in about a minute.

    python3 examples/transformers_llama.py [--steps 60]
"""

import argparse
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dilated_attention.integrations.transformers import DilatedCache, register
from dilated_attention.training import load_corpus
from dilated_attention.training.data import Batches

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
args = parser.parse_args()
torch.manual_seed(0)

register("dilated", segment_lengths=[64, 128, 256], dilation_rates=[1, 2, 4])
config = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
model = LlamaForCausalLM(config)
model.set_attn_implementation("dilated")  # the one line: every layer now runs dilated attention

corpus = load_corpus()
batches = Batches(corpus.train, context=512, batch_size=8, seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
start = time.perf_counter()
for step in range(1, args.steps + 1):
    inputs, _ = batches.next()
    loss = model(inputs, labels=inputs).loss  # transformers shifts the labels by one itself
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 1 or step % 20 == 0:
        print(f"step {step}: loss {loss.item():.3f} nats per byte")
print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s")

model.eval()
prompt = torch.tensor([list(b"def ")])
# DilatedCache keeps the last max(segment_lengths) - 1 = 255 positions per layer (300 new bytes
# slide past that): memory stays constant however long the text. generate takes it as
# past_key_values=, the name every supported transformers version takes (5.24 renamed it
# cache= and warns about the old name).
warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
with torch.no_grad():
    out = model.generate(
        prompt,
        max_new_tokens=300,
        do_sample=True,
        top_p=0.95,
        temperature=0.8,
        pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
        past_key_values=DilatedCache(model),
    )
print(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
