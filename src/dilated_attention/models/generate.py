"""Sampling from a :class:`LongNetLM` through its cache: memory bounded by the longest
segment, however long the text grows."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..ops import validation


def _check_sampling(temperature, top_k, top_p) -> None:
    validation.check_number(temperature, "temperature", 0, meaning=" (0: the likeliest token)")
    if top_k is not None:
        validation.check_positive_int(top_k, "top_k")
    if top_p is not None:
        validation.check_number(top_p, "top_p", 0, 1, low_open=True)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``logits`` ``(B, V)`` -> ``(B,)`` token ids: the likeliest with ``temperature=0``,
    else drawn from ``softmax(logits / temperature)`` kept to the ``top_k`` likeliest
    tokens (and any tied with the ``k``-th) and to the smallest set whose probability
    reaches ``top_p``. A ``-inf`` logit bans its token (each row needs one finite
    logit); NaN and ``+inf`` are refused."""
    _check_sampling(temperature, top_k, top_p)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("logits must be a floating-point tensor of shape (batch, vocab_size)")
    if logits.shape[1] == 0:
        raise ValueError("logits has a vocab_size of 0 (shape (batch, 0)): there is no token to draw")
    # float64: a temperature down to the smallest float64 (1e-320) divides without
    # overflowing the likeliest token's 0, so a tiny temperature samples the likeliest
    # tokens (uniformly among ties), as its limit does.
    logits = logits.double()
    if bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
        raise ValueError("the model's logits hold NaN or +inf: the weights have diverged")
    if bool(torch.isneginf(logits).all(-1).any()):
        raise ValueError("a row of logits is -inf throughout: every token is banned, none can be drawn")
    if temperature == 0:
        return logits.argmax(-1)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probabilities = ordered.softmax(-1)
        likelier = probabilities.cumsum(-1) - probabilities  # the probability of the tokens before each
        drop_sorted = likelier >= top_p
        logits = logits.masked_fill(torch.empty_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    probabilities = logits.softmax(-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


@torch.inference_mode()  # a decode step's small operations cost less without autograd's bookkeeping
def stream(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    cache=None,
) -> Iterator[torch.Tensor]:
    """Yield ``max_new_tokens`` tokens ``(B,)``, one step at a time, after ``prompt``
    (``(P,)`` or ``(B, P)``, ``P >= 1``). The prompt is fed in chunks of the longest
    segment (at most a static cache's ``max_chunk``), each new token alone, all through
    one cache (``cache``, or a new one), in eval mode (the model's mode is restored
    afterwards). A prompt the model refuses leaves ``cache`` as it was."""
    validation.check_non_negative_int(max_new_tokens, "max_new_tokens")
    _check_sampling(temperature, top_k, top_p)
    if not isinstance(prompt, torch.Tensor):
        raise TypeError(f"prompt must be a tensor of token ids, got {validation.type_name(prompt)}")
    tokens = prompt.unsqueeze(0) if prompt.dim() == 1 else prompt
    if tokens.dim() != 2 or 0 in tokens.shape or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(
            f"prompt must be integer token ids of shape (P,) or (batch, P) with batch >= 1 and P >= 1, got "
            f"{prompt.dtype} of shape {tuple(prompt.shape)}"
        )
    device = next(model.parameters()).device
    tokens = tokens.to(device, torch.long)
    model._check_tokens(tokens)  # every chunk's ids, before the first goes into the cache
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache(tokens.shape[0]) if cache is None else cache
        # a static cache takes at most its max_chunk tokens a call (another object: the model refuses it)
        chunk = min(model.config.max_segment, getattr(cache, "max_chunk", None) or model.config.max_segment)
        for start in range(0, tokens.shape[1], chunk):
            logits = model(tokens[:, start : start + chunk], cache=cache)
        for step in range(max_new_tokens):
            token = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
            with torch.inference_mode(False):
                ordinary = token.clone()  # for the caller: an ordinary tensor, not an inference-mode one
            yield ordinary
            if step + 1 < max_new_tokens:
                logits = model(token[:, None], cache=cache)
    finally:
        model.train(was_training)


def generate(model, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """``prompt`` (``(P,)`` or ``(B, P)``) followed by ``max_new_tokens`` sampled tokens,
    in the prompt's shape, int64 on the model's device; ``sampling``: ``temperature``,
    ``top_k``, ``top_p``, ``generator``, ``cache`` (see :func:`stream`)."""
    new = list(stream(model, prompt, max_new_tokens, **sampling))
    batch = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)
    device = next(model.parameters()).device
    out = torch.cat([batch.to(device, torch.long)] + [t[:, None] for t in new], dim=1)
    return out if prompt.dim() == 2 else out.squeeze(0)
