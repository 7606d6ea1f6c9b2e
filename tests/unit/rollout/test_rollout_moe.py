"""Tiny Llama-4 (MoE, chunked attention, NoPE layer with temperature tuning) in a vLLM engine of
this process: after a push of perturbed Megatron weights vLLM's log-probs equal Megatron's.
Also shows the vLLM 0.32 CPU bug the transport works around: without re-prepacking the fused
MoE weights after a reload, the MoE layers compute garbage."""

from __future__ import annotations

import torch

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.parity import logprob_deltas, megatron_from_hf, perturb_
from megatron_rl.rollout.weights import cpu_backend as transport
from megatron_rl.rollout.weights.push import push_megatron_weights

BUCKET = 256 * 1024
EOS = 2


def prompts(count: int, length: int = 8, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (count, length), generator=gen).tolist()


def test_push_makes_vllm_logprobs_equal_megatron_llama4(
    tiny_hf_dirs, megatron_single_rank, monkeypatch
):
    from megatron_rl.rollout.pool import GeneratorPool

    hf_dir = tiny_hf_dirs["tiny-llama4"]
    model = megatron_from_hf(hf_dir)
    perturb_(model, seed=4, noise=0.5)
    config = RolloutConfig(samples_per_prompt=2, max_tokens=40, dtype="float32", max_num_seqs=16)
    with GeneratorPool(hf_dir, config) as pool:
        assert logprob_deltas(model, pool.generate(prompts(4))).mean() > 0.05
        with monkeypatch.context() as patch:  # the upstream bug, unfixed
            patch.setattr(transport, "repack_cpu_stale_layers", lambda model: 0)
            push_megatron_weights(pool, model, bucket_bytes=BUCKET)
            broken = logprob_deltas(model, pool.generate(prompts(4)))
        push_megatron_weights(pool, model, bucket_bytes=BUCKET)
        after = pool.generate(prompts(4))
    assert broken.max() > 1e-2
    delta = logprob_deltas(model, after)
    assert delta.mean() < 1e-5 and delta.max() < 1e-4, (delta.mean(), delta.max())
    # 8 prompt + up to 40 response tokens: past the 32-token attention chunk
    assert max(len(s.prompt_ids) + len(s) for s in after) > 32
    for s in after:  # the default stop token is the model's EOS, kept in the response
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == EOS)
        assert EOS not in s.response_ids[:-1]
