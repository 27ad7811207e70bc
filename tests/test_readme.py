"""The README's code runs as written."""

import os
import re
import subprocess
import sys

import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def snippet(marker: str) -> str:
    """The fenced Python block right after ``<!-- marker -->`` in the README."""
    with open(README) as f:
        text = f.read()
    match = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"README has no python block after <!-- {marker} -->"
    return match.group(1)


def test_quickstart_runs():
    torch.manual_seed(0)
    namespace = {}
    exec(compile(snippet("quickstart"), "README quickstart", "exec"), namespace)
    assert namespace["y"].shape == (2, 1500, 256)
    assert namespace["lse"].shape == (2, 1500, 8)


def test_multi_process_snippet_runs_with_torchrun(tmp_path):
    script = tmp_path / "shards.py"
    script.write_text(snippet("torchrun-snippet"))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 0: shard (1, 1500, 256) -> (1, 1500, 256), (1, 1500, 8, 32)" in result.stdout
    assert "rank 1: shard (1, 1500, 256) -> (1, 1500, 256), (1, 1500, 8, 32)" in result.stdout


def test_decoding_snippet_runs():
    torch.manual_seed(0)
    namespace = {}
    exec(compile(snippet("decoding"), "README decoding", "exec"), namespace)
    cache = namespace["cache"]
    assert cache.position.tolist() == [349, 349]
    assert cache.cached_positions < 8192


def test_static_cache_snippet_compiles_and_runs():
    torch.manual_seed(0)
    namespace = {}
    exec(compile(snippet("static-cache"), "README static cache", "exec"), namespace)
    assert namespace["out"].shape == (1, 1, 8, 64) and namespace["cache"].position.tolist() == [1]


def test_longnet_snippet_runs_and_its_chunks_match_the_whole():
    torch.manual_seed(0)
    namespace = {}
    exec(compile(snippet("longnet"), "README longnet", "exec"), namespace)
    logits, chunks = namespace["logits"], namespace["chunks"]
    assert logits.shape == (2, 1000, 256) and namespace["text"].shape == (60,)
    assert torch.allclose(torch.cat(chunks, 1), logits, rtol=1e-4, atol=1e-4)
