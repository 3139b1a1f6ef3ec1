"""On-policy distillation's reward: a teacher scoring every token the student sampled.

The per-token reward of the student's own sample y (Agarwal et al. 2024, GKD, arXiv:2306.13649, the
reverse-KL case; "on-policy distillation" as Qwen3, arXiv:2505.09388, and Thinking Machines, 2025, use it)
is

    r_t = log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t)

the negative of the k1 estimate of the reverse KL KL(student || teacher) at token t: its expectation
under the student is -KL at that prefix, so maximising the summed reward minimises the reverse KL of
the whole sequence. It is 0 where the teacher and the student agree, whatever they agree on.
Pure tensor math like the rest of `algorithms/`: no models, configs or `.item()`.
"""

from __future__ import annotations

import torch


def teacher_token_rewards(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor,
                          weight: float = 1.0) -> torch.Tensor:
    """The per-token teacher reward, weight x (log p_teacher - log p_student), 0 off the mask.

    Args:
        teacher_logprobs: (N, T) the teacher's log-probs of the sampled tokens.
        student_logprobs: (N, T) the student's (the policy before the update), detached here: the
            reward is a number the estimator reads, not a loss.
        mask: (N, T) bool, True = a token the policy sampled and the loss reads (tool observations
            and padding are False and get 0).
        weight: the term's weight in the reward (`0.5*teacher:DIR` -> 0.5).

    Returns:
        (N, T) rewards, float32 (float64 for float64 inputs).

    Example: teacher log-probs [-0.5, -1.0, -0.2], student [-0.7, -0.4, -0.2] -> rewards
    [0.2, -0.6, 0.0]: the first token is likelier under the teacher (rewarded), the second less
    (punished), the third agrees (0); their sum -0.4 is minus the sequence's k1 reverse KL.
    """
    dtype = torch.promote_types(teacher_logprobs.dtype, torch.float32)  # float32, or float64 given float64
    rewards = teacher_logprobs.to(dtype) - student_logprobs.detach().to(dtype)
    return torch.where(mask, weight * rewards, torch.zeros_like(rewards))


def reverse_kl_per_token(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-dim: the mean over the counted tokens of log p_student - log p_teacher (the k1 estimate of
    KL(student || teacher) per token; NaN with no counted token). Shapes (N, T); mask bool."""
    dtype = torch.promote_types(teacher_logprobs.dtype, torch.float32)
    difference = (student_logprobs.detach().to(dtype) - teacher_logprobs.to(dtype))[mask]
    return difference.mean() if difference.numel() else difference.new_tensor(float("nan"))
