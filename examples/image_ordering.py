"""Does the order of the patches matter to a dilated-attention ViT? A tiny one is
trained on a task that needs 2-D context, once per patch order, and tested.

The task (made on the fly, no download): an image of 32 x 32 patches is cut into
tiles of 4 x 4 patches (the tiling shifted by a random 0-3 patches each way), each
tile black or white at random; then a quarter of the patches are flipped (noise).
For every patch, say its tile's colour: a patch alone is right 75% of the time, the
majority of its tile nearly always. The tile spans 4 rows, which in row-major order
are 32 tokens apart: a segment of 16 holds one row of it, a segment of 64 two rows.
In Z or Hilbert order a tile mostly falls in one or a few segments of 16.

    python3 examples/image_ordering.py [--steps 1000] [--orders row_major zorder hilbert] [--out-dir DIR]

The model: patch embedding (black/white) plus learned row and column embeddings, 2
pre-norm blocks of GridAttention(MultiheadDilatedAttention(w = [16, 64], r = [1, 2],
4 heads)) and an MLP, 64 dims; AdamW; per-patch cross-entropy. Accuracy is over every
patch of 64 test images the model never saw.

The table goes to stdout, one line per order as it finishes; progress (the loss
every tenth of the steps) goes to stderr. With ``--out-dir``, the table (headed by the
machine, dtype and torch version) and its numbers also go to ``image-ordering-cpu.txt``
and ``.json`` there.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

from dilated_attention import GridAttention, MultiheadDilatedAttention
from dilated_attention.nn.ordering import ORDERS
from dilated_attention.tools.benchmark import machine_info, machine_words
from dilated_attention.utils.files import check_output_file, write_results

SIDE, TILE, NOISE, DIM = 32, 4, 0.25, 64


def images(batch: int, generator: torch.Generator):
    """Noisy patches ``(batch, SIDE * SIDE)`` in {0, 1} and each patch's tile colour."""
    tiles = torch.randint(0, 2, (batch, SIDE // TILE + 1, SIDE // TILE + 1), generator=generator)
    shift = torch.randint(0, TILE, (2,), generator=generator).tolist()
    colour = tiles.repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)[
        :, shift[0] : shift[0] + SIDE, shift[1] : shift[1] + SIDE
    ]
    noise = (torch.rand(batch, SIDE, SIDE, generator=generator) < NOISE).long()
    return (colour ^ noise).flatten(1), colour.flatten(1)


class Block(nn.Module):
    def __init__(self, order: str):
        super().__init__()
        attention = MultiheadDilatedAttention(DIM, 4, [16, 64], [1, 2])
        self.attention = GridAttention(attention, order)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.attention(self.norm1(x), grid=(SIDE, SIDE))[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, order: str):
        super().__init__()
        self.patch = nn.Embedding(2, DIM)
        self.row, self.col = (
            nn.Parameter(torch.randn(SIDE, 1, DIM) * 0.1),
            nn.Parameter(torch.randn(1, SIDE, DIM) * 0.1),
        )
        self.blocks = nn.Sequential(Block(order), Block(order))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2))

    def forward(self, patches):  # (B, SIDE * SIDE) row-major, as an image is flattened
        x = self.patch(patches) + (self.row + self.col).flatten(0, 1)
        return self.head(self.blocks(x))


def train_and_test(order: str, steps: int) -> tuple[float, float]:
    """Test accuracy and training seconds of a model trained ``steps`` steps in ``order``;
    the loss on stderr every tenth of the steps."""
    torch.manual_seed(0)
    model = TinyViT(order)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    every = max(1, steps // 10)
    for step in range(1, steps + 1):
        patches, colours = images(16, data)
        loss = nn.functional.cross_entropy(model(patches).flatten(0, 1), colours.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % every == 0 or step == steps:
            print(
                f"{order}: step {step}/{steps}, loss {loss.item():.3f}, {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    seconds = time.perf_counter() - start
    with torch.no_grad():
        patches, colours = images(64, torch.Generator().manual_seed(2))
        accuracy = (model(patches).argmax(-1) == colours).double().mean().item()
    return accuracy, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps per order (default: 1000)")
    parser.add_argument(
        "--orders", nargs="+", choices=ORDERS, default=list(ORDERS), help="patch orders to compare (default: all)"
    )
    parser.add_argument("--out-dir", help="also write image-ordering-cpu.txt and .json into this folder")
    args = parser.parse_args()
    if args.out_dir is not None:
        if not os.path.isdir(args.out_dir):
            parser.error(f"--out-dir {args.out_dir} is not a folder: create it first")
        for extension in (".json", ".txt"):  # before the training, not after it
            try:
                check_output_file(os.path.join(args.out_dir, "image-ordering-cpu" + extension), "--out-dir")
            except ValueError as exc:
                parser.error(str(exc))
    lines = [f"{'order':<10} {'test accuracy':>14} {'train s':>8}"]
    print(lines[0], flush=True)
    results = []
    for order in args.orders:
        accuracy, seconds = train_and_test(order, args.steps)
        results.append({"order": order, "test_accuracy": accuracy, "train_seconds": seconds})
        lines.append(f"{order:<10} {accuracy:>14.1%} {seconds:>8.1f}")
        print(lines[-1], flush=True)
    if args.out_dir is not None:
        machine = machine_info(torch.device("cpu"))
        header = (
            f"patch orders of a tiny dilated ViT (examples/image_ordering.py), {args.steps} steps of 16 images each; "
            f"{machine_words(machine)}, float32"
        )
        payload = {"machine": machine, "dtype": "float32", "steps": args.steps, "results": results}
        write_results(os.path.join(args.out_dir, "image-ordering-cpu"), payload, "\n".join([header, "", *lines]))


if __name__ == "__main__":
    main()
