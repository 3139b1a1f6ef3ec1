"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13): a length-aware reward
shaping that penalises a completion linearly over the last `buffer` tokens before `max_tokens` and by
the full `penalty` past it (DAPO: L_max = max_tokens, L_cache = buffer, penalty 1)."""

from __future__ import annotations

import torch


def overlong_shaping(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """The shaping added to each completion's reward, from its length L (DAPO eq. 13):

        0                                          if L <= max_tokens - buffer
        ((max_tokens - buffer) - L) / buffer * p   if max_tokens - buffer < L <= max_tokens
        -p                                         if L > max_tokens

    (p = `penalty`; eq. 13 is p = 1). Continuous: the ramp is 0 at the start of the buffer zone and
    -p at L = max_tokens.

    Args: `lengths` (N,) the completions' token counts (any integer or float dtype; the caller decides
    what counts: the policy's own tokens); `max_tokens` >= 1; `buffer` in (0, max_tokens]; `penalty` >= 0.
    Returns: (N,) float32 (float64 if `lengths` is float64), <= 0, on `lengths`' device.

    Example, max_tokens 20, buffer 4, penalty 1 (the zone starts after 16 tokens):

    >>> overlong_shaping(torch.tensor([15, 16, 18, 20, 25]), max_tokens=20, buffer=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])

    (18: (16 - 18) / 4 = -0.5; 20: (16 - 20) / 4 = -1; 25 > 20: -1.)
    """
    if max_tokens < 1 or not 0 < buffer <= max_tokens or penalty < 0:
        raise ValueError(f"overlong shaping needs max_tokens >= 1, 0 < buffer <= max_tokens and penalty >= 0, "
                         f"got {max_tokens}, {buffer}, {penalty}")
    lengths = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    start = max_tokens - buffer  # the expected length: below it no shaping
    ramp = (start - lengths) / buffer * penalty  # arXiv:2503.14476 eq. 13, middle case
    return torch.where(lengths <= start, torch.zeros_like(ramp), torch.where(lengths <= max_tokens, ramp, torch.full_like(ramp, -penalty)))
