"""The vLLM generator pool end to end (engines in this process, tiny models, fp32).

- After a push of perturbed Megatron weights, vLLM's sampled-token log-probs equal Megatron's
  (FP32 head); before the push they differ.
- In-flight pushes: requests started before a push finish; their later tokens carry the new
  version and have the log-probs of the new weights, computed by transformers (an independent
  reference) on the KV cache the engine actually had: old weights' KV before the push ("keep"),
  or all KV recomputed by the new weights ("recompute").
- Staleness: the oldest version in flight.

The Llama-4 (MoE) engine lives in test_rollout_moe.py: vLLM's parallel groups are
process-wide, so a dense and an MoE engine cannot share a process.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import transformers

from megatron_rl.conversion.weight_stream import iter_hf_weights
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.parity import logprob_deltas, megatron_from_hf, perturb_
from megatron_rl.rollout.weights.push import push_megatron_weights

BUCKET = 256 * 1024


def prompts(count: int, length: int = 8, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (count, length), generator=gen).tolist()


def hf_state(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in iter_hf_weights(model, BUCKET) for n, t in b}


def hf_model(hf_dir: str, state: dict[str, torch.Tensor]):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def response_logprobs(logits: torch.Tensor, seq: list[int], first: int) -> torch.Tensor:
    """log p(seq[t]) for t >= first, from logits whose row i predicts seq[offset + i + 1]."""
    logp = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor(seq[first:])
    return logp[torch.arange(len(targets)), targets]


def reference_logprobs(old, new, sample, switch: int | None, keep_kv: bool) -> torch.Tensor:
    """transformers log-probs of the response: tokens before ``switch`` by the old model; after
    it by the new model, attending to the old model's KV of the positions computed before the
    push (``keep_kv``) or to its own (recompute)."""
    seq = sample.prompt_ids + sample.response_ids
    p = len(sample.prompt_ids)
    ids = torch.tensor([seq])
    with torch.no_grad():
        old_all = response_logprobs(old(ids).logits[0, p - 1 : -1], seq, p)
        if switch is None:
            return old_all
        if not keep_kv:
            new_all = response_logprobs(new(ids).logits[0, p - 1 : -1], seq, p)
            return torch.cat([old_all[:switch], new_all[switch:]])
        # KV of positions [0, p + switch - 1) was written by the old weights
        cut = p + switch - 1
        cache = old(ids[:, :cut], use_cache=True).past_key_values
        logits = new(ids[:, cut:], past_key_values=cache, use_cache=True).logits[0, :-1]
        return torch.cat([old_all[:switch], response_logprobs(logits, seq, cut + 1)])


@pytest.fixture(scope="module")
def dense(tiny_hf_dirs, megatron_single_rank_module):
    from megatron_rl.rollout.pool import GeneratorPool

    hf_dir = tiny_hf_dirs["tiny-llama"]
    config = RolloutConfig(
        engines=2,
        samples_per_prompt=2,
        max_tokens=24,
        dtype="float32",
        stop_token_ids=[],  # no EOS: every sample runs to its length (in-flight test)
        max_num_seqs=16,
        seed=0,
    )
    pool = GeneratorPool(hf_dir, config)
    yield SimpleNamespace(hf_dir=hf_dir, model=megatron_from_hf(hf_dir), pool=pool)
    pool.close()


def test_push_makes_vllm_logprobs_equal_megatron_dense(dense):
    model, pool = dense.model, dense.pool
    version = pool.version + 1  # the module's other tests push too
    perturb_(model, seed=1, noise=0.5)
    before = pool.generate(prompts(6))
    stale = logprob_deltas(model, before)
    assert stale.mean() > 0.05  # vLLM still runs the HF weights: the check can fail
    stats = push_megatron_weights(pool, model, bucket_bytes=BUCKET)
    assert stats.version == pool.version == version and stats.buckets > 2 and stats.bytes > 4e6
    after = pool.generate(prompts(6))
    assert len(after) == 12 and {s.engine for s in after} == {0, 1}  # both engines pushed
    assert all(v == version for s in after for v in s.versions)
    delta = logprob_deltas(model, after)
    assert delta.numel() == 12 * 24
    assert delta.mean() < 1e-5 and delta.max() < 1e-4, (delta.mean(), delta.max())
    # at another temperature the generator's log-probs are those of the tempered distribution
    hot = pool.generate(prompts(3), temperature=0.7)
    assert logprob_deltas(model, hot).mean() > 1e-2
    delta = logprob_deltas(model, hot, temperature=0.7)
    assert delta.mean() < 1e-5 and delta.max() < 1e-4, (delta.mean(), delta.max())


@pytest.mark.timeout(300)
def test_tied_head_follows_the_pushed_embedding(tiny_hf_dirs, megatron_single_rank):
    """A model with ``tie_word_embeddings``: the engine's lm_head is the embedding's parameter,
    never loaded itself; vLLM 0.32 CPU kept its GEMM packed from the first load, so the
    generator sampled from a stale head after every push (fixed in rollout.transport)."""
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights import cpu_backend as transport

    hf_dir = tiny_hf_dirs["tiny-llama-tied"]
    model = megatron_from_hf(hf_dir)
    assert model.share_embeddings_and_output_weights
    perturb_(model, seed=2, noise=0.5)
    config = RolloutConfig(samples_per_prompt=2, max_tokens=24, dtype="float32", max_num_seqs=16)
    with GeneratorPool(hf_dir, config) as pool:
        assert logprob_deltas(model, pool.generate(prompts(4))).mean() > 0.05
        with pytest.MonkeyPatch.context() as patch:  # the upstream bug, unfixed
            patch.setattr(transport, "repack_cpu_stale_layers", lambda model: 0)
            push_megatron_weights(pool, model, bucket_bytes=BUCKET)
            broken = logprob_deltas(model, pool.generate(prompts(4)))
        push_megatron_weights(pool, model, bucket_bytes=BUCKET)
        delta = logprob_deltas(model, pool.generate(prompts(4)))
    assert broken.mean() > 1e-2, broken.mean()
    assert delta.mean() < 1e-5 and delta.max() < 1e-4, (delta.mean(), delta.max())


def _in_flight(pool, model, kv_on_push: str, seed: int):
    """Start long requests, push new weights once they are under way, wait for them."""
    old = hf_state(model)
    perturb_(model, seed=seed, noise=0.5)
    new = hf_state(model)
    version = pool.version
    pool.submit(prompts(4, seed=seed), samples_per_prompt=1, max_tokens=300)
    deadline = time.monotonic() + 60
    while sum(s["tokens"] for s in pool.engine_status()) < 40:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pool.push_weights(iter_hf_weights(model, BUCKET), kv_on_push=kv_on_push)
    staleness = pool.staleness
    samples = []
    while len(samples) < 4:
        samples += pool.poll(timeout=5.0)
    return old, new, version, staleness, samples


@pytest.mark.parametrize("kv_on_push", ["keep", "recompute"])
def test_in_flight_push(dense, kv_on_push):
    pool = dense.pool
    seed = {"keep": 2, "recompute": 3}[kv_on_push]
    old_state, new_state, version, staleness, samples = _in_flight(
        pool, dense.model, kv_on_push, seed
    )
    assert pool.version == version + 1
    assert staleness == 1  # the requests started before the push were still in flight
    assert pool.staleness == 0 and pool.oldest_version_in_flight() is None
    old, new = hf_model(dense.hf_dir, old_state), hf_model(dense.hf_dir, new_state)
    switched = 0
    for s in samples:
        assert len(s) == 300 and s.finish_reason == "length"  # kept and finished
        n_old = s.versions.count(version)
        assert s.versions == [version] * n_old + [version + 1] * (300 - n_old)
        assert 300 - n_old > 0  # tokens after the push carry the new version
        switched += n_old > 0
        got = torch.tensor(s.logprobs)
        ref = reference_logprobs(old, new, s, n_old or None, keep_kv=kv_on_push == "keep")
        assert (got - ref).abs().mean() < 1e-5 and (got - ref).abs().max() < 1e-4
        if n_old:  # ... and not the old weights' log-probs
            stale = reference_logprobs(old, new, s, None, keep_kv=True)
            assert (got[n_old:] - stale[n_old:]).abs().mean() > 1e-2
    assert switched >= 1  # at least one request produced tokens with both versions


def test_a_push_feeds_the_pool_while_it_waits(dense):
    """``push_weights(between=...)`` calls back after each bucket and while it waits, with the
    old version still current: the callback (the rollout source's ``feed``) collects what
    finished and submits new requests during the push. None is lost; each sample's tokens are
    of the old version, then the new; those generated by the new weights have its log-probs."""
    pool, model = dense.pool, dense.model
    version = pool.version
    perturb_(model, seed=4, noise=0.5)
    pool.submit(prompts(4, seed=4), samples_per_prompt=1, max_tokens=6)  # short: done soon
    seen_versions, collected, submitted = set(), [], []

    def between():
        seen_versions.add(pool.version)
        collected.extend(pool.poll(0.0))
        batch = prompts(1, seed=100 + len(submitted))
        submitted.extend(pool.submit(batch, samples_per_prompt=2, max_tokens=6))

    stats = push_megatron_weights(pool, model, bucket_bytes=BUCKET, between=between)
    assert stats.version == pool.version == version + 1 and seen_versions == {version}
    assert len(submitted) >= stats.buckets > 2  # at least once per bucket
    done = list(collected)
    deadline = time.monotonic() + 120
    while pool.in_flight:
        assert time.monotonic() < deadline
        done += pool.poll(timeout=1.0)
    keys = [(s.prompt_index, s.sample_index) for s in done]
    assert len(keys) == len(set(keys)) == 4 + 2 * len(submitted)  # every request, once
    assert {k[0] for k in keys} >= set(submitted)
    for s in done:
        assert len(s) == 6 and set(s.versions) <= {version, version + 1}
        assert s.versions == sorted(s.versions)
    new = [s for s in done if s.prompt_index in submitted and set(s.versions) == {version + 1}]
    assert new  # submitted while the engines loaded: generated by the new weights only
    delta = logprob_deltas(model, new)
    assert delta.mean() < 1e-5 and delta.max() < 1e-4, (delta.mean(), delta.max())


def test_engine_idle_fractions_bracket_the_time_each_engine_held_a_request(dense):
    """Each engine's idle fraction is of its own requests: with one request on one of the two
    engines, the other is idle all the time and this one except while the pool had the
    request out (from within ``submit`` to within the ``poll`` that returned it)."""
    pool = dense.pool
    assert not pool.in_flight
    before_reset = time.monotonic()
    pool.reset_engine_load()
    after_reset = time.monotonic()
    time.sleep(0.5)
    submitting = time.monotonic()
    pool.submit(prompts(1, seed=9), samples_per_prompt=1, max_tokens=24)
    submitted = polling = time.monotonic()
    done = []
    while not done:
        polling = time.monotonic()
        done = pool.poll(timeout=0.05)
    returned = time.monotonic()
    time.sleep(0.5)
    before_read = time.monotonic()
    fractions = pool.engine_idle_fractions()
    after_read = time.monotonic()
    busy, other = done[0].engine, 1 - done[0].engine
    assert fractions[other] == 1.0
    # busy from [submitting, submitted] to [polling, returned], over a window of the pool's
    longest = (returned - submitting) / (before_read - after_reset)
    shortest = max(polling - submitted, 0.0) / (after_read - before_reset)
    assert 1 - longest <= fractions[busy] <= 1 - shortest, (fractions, longest, shortest)
    assert fractions[busy] < 1.0
    pool.reset_engine_load()  # a new window: nothing in flight, idle throughout
    time.sleep(0.05)
    assert pool.engine_idle_fractions() == [1.0, 1.0]


def test_an_engine_joins_its_weight_transport_again_and_still_loads_pushes(dense):
    """A group transport (nccl) is formed anew after a death: every engine first leaves its
    group through vLLM's ``shutdown_weight_transfer_engine``, then joins the new one. On
    the real CPU workers (whose backend has no group): both calls run, and a push after the
    second join still lands in both engines."""
    from megatron_rl.rollout.messages import JoinTransport

    model, pool = dense.model, dense.pool
    for handle in pool.engine_handles():
        handle.send(JoinTransport({}))
    deadline = time.monotonic() + 120
    while pool.joined_transport != {0, 1}:
        assert time.monotonic() < deadline, "the engines never joined again"
        pool.poll()
        time.sleep(0.1)
    perturb_(model, seed=3, noise=0.5)
    assert logprob_deltas(model, pool.generate(prompts(4))).mean() > 0.05
    push_megatron_weights(pool, model, bucket_bytes=BUCKET)
    after = pool.generate(prompts(4))
    assert {s.engine for s in after} == {0, 1}
    delta = logprob_deltas(model, after)
    assert delta.mean() < 1e-5 and delta.max() < 1e-4, (delta.mean(), delta.max())


def test_bad_requests_are_refused_with_clear_errors(dense):
    pool, version = dense.pool, dense.pool.version
    with pytest.raises(ValueError, match="empty prompt"):
        pool.submit([[]])
    with pytest.raises(ValueError, match="out of the vocabulary"):
        pool.submit([[1, 128]])
    with pytest.raises(ValueError, match="does not fit max_model_len 512"):
        pool.submit([[5] * 512])
    with pytest.raises(ValueError, match="kv_on_push"):
        pool.push_weights([], kv_on_push="drop")
    with pytest.raises(ValueError, match="no buckets"):
        pool.push_weights([])
    assert pool.version == version and pool.in_flight == 0
    # refused before any engine was told: each still runs the pool's version (when the refusal
    # came after the Push commands, each ran the next one, ahead of the pool)
    assert [s["version"] for s in pool.engine_status()] == [version, version]


def test_moe_engine_next_to_a_dense_one_is_refused_clearly(dense, tiny_hf_dirs):
    from megatron_rl.rollout.pool import GeneratorPool

    with pytest.raises(RuntimeError, match="MoE model cannot get an in-process vLLM engine"):
        GeneratorPool(tiny_hf_dirs["tiny-llama4"], RolloutConfig(dtype="float32"))
