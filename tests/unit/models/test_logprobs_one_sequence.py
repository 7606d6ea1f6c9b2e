"""``logits_to_logprobs`` on a micro-batch of one row (every packed micro-batch, and a padded
one that holds a single long sequence): megatron-core's vocab-parallel cross entropy works on
its input in place, and the [s, 1, V] transpose's contiguous() is the view itself, which
autograd refused in the backward ("Output 0 of Transpose is a view ... modified inplace"):
the CPU suite's MoE updates failed so once packed."""

from __future__ import annotations

import torch


def test_one_row_logprobs_and_their_gradient_equal_a_float64_log_softmax(megatron_single_rank):
    from megatron_rl.models.logprobs import logits_to_logprobs

    torch.manual_seed(0)
    base = torch.randn(1, 9, 32, dtype=torch.float32)
    tokens = torch.randint(0, 32, (1, 9))
    hidden = base.clone().requires_grad_(True)
    logits = hidden * 1.0  # a non-leaf, as a model's output is
    logprobs = logits_to_logprobs(logits, tokens)
    logprobs.sum().backward()

    ref_in = base.double().requires_grad_(True)
    ref = torch.log_softmax(ref_in[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    ref.sum().backward()
    assert torch.allclose(logprobs.double(), ref, atol=1e-5)
    assert torch.allclose(hidden.grad.double(), ref_in.grad, atol=1e-5)
    assert torch.equal(logits.detach(), base)  # the model's output is left as it was
