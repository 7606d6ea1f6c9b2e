"""Packed micro-batches (batch.pack): the plan fills the budget, a packed sequence's logits
are its own, and the update is the padded one."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.models import ModelConfig
from megatron_rl.models.logprobs import forward_logits, packed_positions
from megatron_rl.models.provider import build_model
from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer.batch import TrainSample, make_micro_batches
from megatron_rl.trainer.packing import cu_seqlens_of, make_packed_micro_batches, plan_packed


def test_plan_packed_is_first_fit_decreasing():
    # by hand, budget 10, longest first: 12 alone (over the budget); 9 -> B; 7 -> C; 5 -> D;
    # 3 -> C (10); 2 -> D (7: B would be 11); 1 -> B (10)
    lengths = [5, 9, 1, 7, 3, 12, 2]
    plan = plan_packed(lengths, 10)
    assert plan == [[5], [1, 2], [3, 4], [0, 6]]
    assert sorted(i for part in plan for i in part) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="tokens"):
        plan_packed(lengths, 0)


def test_positions_restart_in_every_sequence():
    cu = cu_seqlens_of([3, 1, 2], multiple=4)  # 6 tokens, padded to 8 by a segment of 2
    assert cu.tolist() == [0, 3, 4, 6, 8] and cu.dtype == torch.int32
    assert packed_positions(cu).tolist() == [0, 1, 2, 0, 0, 1, 0, 1]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama4"])
def test_a_packed_sequence_has_the_logits_it_has_alone(megatron_single_rank, preset):
    """RoPE positions restart, Llama-4's chunked attention (chunk 32) and NoPE temperature
    tuning count from each sequence's start, and no token sees another sequence: a pack of
    three sequences (one longer than a chunk) gives each the logits it gets alone."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, dtype="float32"), ParallelConfig()).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 128, (n,), generator=gen) for n in (40, 7, 19)]
    cu = cu_seqlens_of([len(q) for q in seqs])
    with torch.no_grad():
        packed = forward_logits(model, torch.cat(seqs)[None], cu_seqlens=cu)[0]
        alone = [forward_logits(model, q[None])[0] for q in seqs]
        shifted = forward_logits(model, torch.cat(seqs)[None])[0]  # no packing: differs
    for q, a, (start, end) in zip(seqs, alone, zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert torch.allclose(packed[start:end], a, atol=1e-5, rtol=0), (preset, len(q))
    assert not torch.allclose(shifted[40:47], alone[1], atol=1e-3)


def _samples(seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for group, rewards in enumerate([[1, -1, -1], [1, 0, 1], [-1, 1, -1]]):
        prompt = torch.randint(
            3, 128, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen
        )
        for r in rewards:
            n = int(torch.randint(2, 12, (1,), generator=gen))
            samples.append(
                TrainSample(
                    group, group, prompt.tolist(), torch.randint(3, 128, (n,), generator=gen).tolist(),
                    (-torch.rand(n, generator=gen) * 5).tolist(), [True] * n, float(r), [0] * n,
                )
            )  # fmt: skip
    return samples


def test_packed_micro_batches_carry_the_padded_tensors_in_the_same_order():
    samples = _samples(0)
    adv, keep = torch.arange(9.0), torch.ones(9, dtype=torch.bool)
    padded = make_micro_batches(samples, adv, keep, micro_batch_tokens=40)
    packed = make_packed_micro_batches(samples, adv, keep, micro_batch_tokens=40, multiple=4)
    assert all(mb.tokens.shape[1] <= 40 and mb.tokens.shape[1] % 4 == 0 for mb in packed)
    assert len(packed) <= len(padded)
    total = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    assert sum(int(mb.padding.sum()) for mb in packed) < 4 * len(packed)
    assert sum(int((~mb.padding).sum()) for mb in packed) == total
    for name in ("gen_logprobs", "advantages", "sample_ids"):
        by_id = {}
        for mb in padded:
            for sid, v in zip(mb.sample_ids.tolist(), getattr(mb, name).tolist()):
                by_id.setdefault(sid, []).append(v)
        got = {}
        for mb in packed:
            for sid, v in zip(mb.sample_ids.tolist(), getattr(mb, name).tolist()):
                got.setdefault(sid, []).append(v)
        assert got == by_id, name
    for mb in packed:  # the selected positions predict exactly the response tokens
        targets = mb.tokens[0, 1:][mb.select[0]]
        sids = mb.sample_ids.unique_consecutive().tolist()
        assert targets.tolist() == [t for i in sids for t in samples[i].response_tokens]


def _update(model, samples, **kwargs):
    """The SGD (lr 1: the raw gradient) update's parameters and result; the model restored."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.trainer.step import policy_update

    cfg = OptimizerConfig(
        optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    opt = get_megatron_optimizer(cfg, [model], use_gloo_process_groups=False)
    before = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    result = policy_update(model, opt, samples, AlgorithmConfig(), **kwargs)
    after = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
    with torch.no_grad():
        for k, p in model.module.named_parameters():
            p.copy_(before[k])
    return after, result


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama4"])
def test_packed_update_equals_the_padded_update(megatron_single_rank, preset):
    """fp32: the packed step's loss, statistics and SGD update equal the padded step's (and
    a step that attended across sequences would not: the update moves ~0.1)."""
    from megatron_rl.trainer.optim import wrap_model

    torch.manual_seed(0)
    model = wrap_model(build_model(ModelConfig(preset=preset, dtype="float32"), ParallelConfig()))
    samples = _samples(3)
    initial = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
    padded, a = _update(model, samples, micro_batch_tokens=48, pack=False)
    packed, b = _update(model, samples, micro_batch_tokens=48, pack=True, token_multiple=8)
    assert float((padded - initial).abs().max()) > 1e-2
    assert torch.allclose(packed, padded, atol=1e-6, rtol=0)
    for field in ("loss", "grad_norm", "rho_mean", "abs_logprob_diff", "mismatch_kl"):
        assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-5, abs=1e-7), field
    assert b.num_tokens == a.num_tokens > 0


def test_batch_pack_is_a_bool_or_null():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.sections import BatchConfig

    BatchConfig(pack=True).validate()
    BatchConfig(pack=None).validate()
    with pytest.raises(ConfigError, match="pack"):
        BatchConfig(pack="yes").validate()


def test_packing_fills_the_budget_where_padding_does_not():
    """48 lognormal reasoning lengths a rank (tools/bench_packing.py's model, 20 draws): packed
    micro-batches are the fewest any plan can have (ceil(tokens / budget)) and, but for the
    remainder, >= 95% full with no padding; padded ones need more and pad."""
    import math

    import numpy as np

    rng = np.random.default_rng(0)
    for budget in (16384, 32768):
        for _ in range(20):
            lengths = [512 + int(x) for x in np.minimum(rng.lognormal(7.6, 1.0, 48), budget - 512)]
            packed = plan_packed(lengths, budget)
            fewest = math.ceil(sum(lengths) / budget)
            assert len(packed) <= fewest + 1
            filled = sorted(sum(lengths[i] for i in part) for part in packed)
            assert filled[-1] <= budget and sum(filled[1:]) >= 0.95 * budget * (len(filled) - 1)
            padded = make_plan_padded(lengths, budget)
            assert len(padded) >= len(packed)


def make_plan_padded(lengths, budget):
    from megatron_rl.trainer.batch import plan_micro_batches

    return plan_micro_batches(lengths, tokens=budget)


def test_a_packed_forward_refuses_a_batch_its_cu_seqlens_do_not_describe(megatron_single_rank):
    cu = cu_seqlens_of([3, 2])
    with pytest.raises(ValueError, match="packed micro-batch is"):
        forward_logits(None, torch.zeros((2, 5), dtype=torch.long), cu_seqlens=cu)
    with pytest.raises(ValueError, match="ending at 5"):
        forward_logits(None, torch.zeros((1, 6), dtype=torch.long), cu_seqlens=cu)


def test_packed_attention_reads_cu_seqlens_once_per_forward():
    """Every layer gets the same PackedSeqParams: the sequence bounds are read from the
    (on GPU, device) tensor once, not at every layer (a device sync each time)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models.attention import host_bounds

    class Counted:
        calls = 0

        def tolist(self):
            Counted.calls += 1
            return [0, 3, 5]

    cu = Counted()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert [host_bounds(params) for _ in range(4)] == [[0, 3, 5]] * 4
    assert Counted.calls == 1
    fresh = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert host_bounds(fresh) == [0, 3, 5] and Counted.calls == 2  # a new micro-batch reads


class _DeviceReads(TorchFunctionMode):
    """Counts, by call site, the host's reads of tensor values (``tolist``, ``item``,
    ``bool(t)``, ``int(t)``, ...) during a CPU forward, of the tensors that would be on the
    GPU there, where each read is a device sync: every tensor but those made on the host (a
    factory without ``device``: ``torch.tensor(bounds)``) and those computed from them. Reads
    inside torch kernels (``repeat_interleave`` without ``output_size``) are not seen."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__}
    READS |= {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
    FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full}

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in self.READS and id(args[0]) not in self.host:
            caller = next(
                f for f in reversed(traceback.extract_stack()[:-1]) if "torch/" not in f.filename
            )
            self.sites[f"{Path(caller.filename).name}:{caller.lineno}"] += 1
        out = func(*args, **kwargs)
        moved = func in (torch.Tensor.to, torch.Tensor.cuda) and (
            "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
        )
        if (func in self.FACTORIES and kwargs.get("device") is None) or (
            not moved and any(id(t) in self.host for t in inputs)
        ):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.host[id(t)] = t
        return out


@pytest.fixture(scope="module")
def llama4(megatron_single_rank_module):
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny-llama4", dtype="float32"), ParallelConfig()).eval()


@pytest.mark.parametrize("lengths", [(40, 7, 19), (50,)])
def test_a_packed_forward_reads_its_bounds_from_the_device_once(llama4, lengths, monkeypatch):
    """megatron-core 0.16.1's unfused THD RoPE (Llama-4, interleaved) read cu_seqlens at every
    call, query and key of every RoPE layer (rope_utils.py:204 tolist, 211 a tensor as a bool,
    218 item per sequence when one sequence fills the pack): 12-18 device syncs in tiny-llama4's
    three RoPE layers, plus the forward's own. Now one read per forward, the same logits bit
    for bit as megatron's own RoPE on the device tensor; the other reads of the forward are the
    MoE dispatch's, which the padded forward makes too."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.models import logprobs

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 128, (1, sum(lengths)), generator=gen)
    cu = cu_seqlens_of(lengths)
    with torch.no_grad():
        with _DeviceReads() as packed:
            forward_logits(llama4, tokens, cu_seqlens=cu)
        with _DeviceReads() as padded:
            forward_logits(llama4, tokens)
        rope = {site: n for site, n in packed.sites.items() if site.startswith("rope_utils")}
        assert rope == {}, packed.sites
        assert sum(packed.sites.values()) == sum(padded.sites.values()) + 1, packed.sites
        out = forward_logits(llama4, tokens, cu_seqlens=cu)
        # megatron's own THD RoPE, on the (device) cu_seqlens itself
        monkeypatch.setattr(
            rope_utils, "_apply_rotary_pos_emb_thd", logprobs._rope_thd_on_host.megatron
        )
        monkeypatch.setattr(logprobs, "_install_rope_thd_on_host", lambda: None)
        monkeypatch.setattr(logprobs, "_HOST_COPY", "_not_set")
        assert torch.equal(forward_logits(llama4, tokens, cu_seqlens=cu), out)
