"""Global normalisers over 2 gloo ranks: summed gradients equal the one-batch gradient."""

import datetime
import itertools
import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.algorithms import (
    AGGREGATIONS,
    LOSSES,
    compute_advantages,
    compute_loss_normalizers,
    policy_loss,
)
from megatron_rl.platform import run_local_ranks

PARAMS = {
    "cispo": {"eps_max": 1.3},
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28},
    "gspo": {"eps_low": 0.05, "eps_high": 0.08},
    "reinforce": {},
}
VOCAB, DIM = 7, 5
# rank 0: samples 0-4 in two micro-batches; rank 1: samples 5-11 in one. Prompt 1
# (samples 3, 4, 5) spans both ranks.
RANK_MICRO_BATCHES = {0: [[0, 1], [2, 3, 4]], 1: [[5, 6, 7, 8, 9, 10, 11]]}


def make_problem():
    """A linear softmax policy W [V, D] and a batch of 4 prompts x 3 samples."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(VOCAB, DIM, generator=gen)
    gen_weight = weight + 0.3 * torch.randn(VOCAB, DIM, generator=gen)  # stale generator
    lengths = torch.randint(2, 9, (12,), generator=gen)
    lengths[7] = 1
    sids = torch.arange(12).repeat_interleave(lengths)
    pids = sids // 3
    feats = torch.randn(len(sids), DIM, generator=gen)
    tokens = torch.randint(0, VOCAB, (len(sids),), generator=gen)
    mask = torch.rand(len(sids), generator=gen) > 0.2
    rewards = torch.tensor([1.0, -1, 1, -1, -1, 1, 1, 1, -1, 1, -1, -1])
    sample_adv = compute_advantages(rewards, torch.arange(12) // 3, "batch")
    with torch.no_grad():
        gen_logprobs = _logprobs(gen_weight, feats, tokens)
    return weight, feats, tokens, gen_logprobs, sample_adv[sids], mask, sids, pids


def _logprobs(weight, feats, tokens):
    return torch.log_softmax(feats @ weight.T, dim=-1).gather(1, tokens[:, None])[:, 0]


def _grad(kind, aggregation, problem, micro_batches, group=None):
    """Sum of the micro-batches' gradients w.r.t. W, with normalisers over ``group``."""
    weight0, feats, tokens, glp, adv, mask, sids, pids = problem
    weight = weight0.clone().requires_grad_()
    local = torch.isin(sids, torch.tensor(sum(micro_batches, [])))
    norm = compute_loss_normalizers(mask[local], sids[local], pids[local], group=group)
    for samples in micro_batches:
        sel = torch.isin(sids, torch.tensor(samples))
        lp = _logprobs(weight, feats[sel], tokens[sel])
        loss, _ = policy_loss(
            kind, lp, glp[sel], adv[sel], mask[sel], sids[sel], pids[sel], aggregation,
            normalizers=norm, **PARAMS[kind],
        )  # fmt: skip
        loss.backward()
    return weight.grad, norm


def _worker() -> dict:
    """One gloo rank (env:// from run_local_ranks): its gradients after the DP reduction."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        problem = make_problem()
        results = {}
        for kind, aggregation in itertools.product(LOSSES, AGGREGATIONS):
            grad, norm = _grad(
                kind, aggregation, problem, RANK_MICRO_BATCHES[rank], dist.group.WORLD
            )
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # DP gradient reduction: a SUM
            results[(kind, aggregation)] = grad
        results["norm"] = norm
        return results
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_batch():
    by_rank = run_local_ranks(_worker, 2)
    problem = make_problem()
    full_norm = compute_loss_normalizers(problem[5], problem[6], problem[7])
    for results in by_rank:
        norm = results["norm"]
        assert torch.equal(norm.sample_keys, full_norm.sample_keys)
        assert torch.equal(norm.sample_tokens, full_norm.sample_tokens)
        assert torch.equal(norm.prompt_keys, full_norm.prompt_keys)
        assert torch.equal(norm.prompt_tokens, full_norm.prompt_tokens)
        for kind, aggregation in itertools.product(LOSSES, AGGREGATIONS):
            expected, _ = _grad(kind, aggregation, problem, [list(range(12))])
            got = results[(kind, aggregation)]
            assert expected.abs().max() > 1e-3
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_gpu_ranks_are_spawned_and_cpu_ranks_forked_from_the_preloaded_server(monkeypatch):
    """run_local_ranks forks CPU ranks from a fork server that imported torch and megatron;
    on GPU nothing that may have touched CUDA is forked: its ranks are spawned."""
    import torch.multiprocessing as mp

    import megatron_rl.platform.parallel as parallel
    from megatron_rl.platform.device import Platform

    methods = []

    def start_processes(fn, args, nprocs, start_method):
        methods.append(start_method)
        raise InterruptedError  # stop before the ranks' results are read

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(mp, "start_processes", start_processes)
    for platform in (Platform("cuda", "nccl", False), Platform("cpu", "gloo", False)):
        monkeypatch.setattr(parallel, "get_platform", lambda platform=platform: platform)
        with pytest.raises(InterruptedError):
            run_local_ranks(_worker, 2)
    assert methods == ["spawn", "forkserver"]
