"""Forced interruptions in a real vLLM engine, checked against greedy decoding by transformers.

With greedy sampling every response is known in advance (transformers, an independent
implementation, decodes the same weights). The think-close marker is chosen as a token that
one prompt's greedy continuation emits early and another's never does within the budget:
the first prompt's samples must be untouched, the second's cut at their drawn budget, followed
by the interruption text exactly once and a greedy answer of at most the answer budget.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.rollout.config import DEFAULT_INTERRUPTION_TEXT, InterruptionConfig, RolloutConfig
from megatron_rl.rollout.engine.interruption import count_subsequence

LO, HI, ANSWER, MAX_TOKENS = 8, 12, 6, 20


def greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def choose_marker(continuations: dict[int, list[int]]) -> tuple[int, int, int]:
    """(closing prompt, marker token, non-closing prompt)."""
    for x, cont in continuations.items():
        for k in range(1, LO - 1):
            marker = cont[k]
            others = [y for y, c in continuations.items() if y != x and marker not in c[:HI]]
            if others:
                return x, marker, others[0]
    raise AssertionError("no usable marker token in the greedy continuations")


@pytest.fixture(scope="module")
def setup(tiny_hf_dirs):
    hf_dir = tiny_hf_dirs["tiny-llama"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 128, (8, 6), generator=gen).tolist()
    continuations = {i: greedy(hf, p, MAX_TOKENS) for i, p in enumerate(prompts)}
    x, marker, y = choose_marker(continuations)
    alphabet = [t for t in range(3, 128) if t != marker]

    def encode(text: str) -> list[int]:  # "</think>" is one token, as in real tokenizers
        parts = text.split("</think>")
        ids: list[int] = []
        for i, part in enumerate(parts):
            ids += [alphabet[ord(ch) % len(alphabet)] for ch in part]
            if i < len(parts) - 1:
                ids.append(marker)
        return ids

    return hf, hf_dir, prompts, continuations, x, y, encode


def test_interruptions_cut_at_the_budget_and_leave_closed_thinking_alone(setup):
    from megatron_rl.rollout.pool import GeneratorPool

    hf, hf_dir, prompts, continuations, x, y, encode = setup
    config = RolloutConfig(
        samples_per_prompt=4,
        max_tokens=MAX_TOKENS,
        dtype="float32",
        stop_token_ids=[],
        interruption=InterruptionConfig(
            enabled=True, thinking_budget=(LO, HI), answer_budget=ANSWER, seed=3
        ),
    )
    text = encode(DEFAULT_INTERRUPTION_TEXT)
    with GeneratorPool(hf_dir, config, encode=encode) as pool:
        assert pool.policy.text_ids == tuple(text)
        samples = pool.generate([prompts[x], prompts[y]], temperature=0.0)
    closing = [s for s in samples if s.prompt_ids == prompts[x]]
    cut = [s for s in samples if s.prompt_ids == prompts[y]]
    assert len(closing) == len(cut) == 4
    budgets = [s.thinking_budget for s in samples]
    assert all(LO <= b <= HI for b in budgets) and len(set(budgets)) > 1

    for s in closing:  # closed its thinking early: exactly the uninterrupted generation
        assert not s.interrupted and s.response_ids == continuations[x]
        assert all(s.mask) and s.finish_reason == "length"

    for s in cut:
        b = s.thinking_budget
        assert s.interrupted and s.response_ids[:b] == continuations[y][:b]
        assert s.response_ids[b : b + len(text)] == text
        assert count_subsequence(s.response_ids, text) == 1
        assert s.mask == [True] * b + [False] * len(text) + [True] * ANSWER
        assert all(lp == 0.0 for lp in s.logprobs[b : b + len(text)])
        assert len(s) == b + len(text) + ANSWER  # the answer budget bounds the rest
        answer = greedy(hf, prompts[y] + s.response_ids[: b + len(text)], ANSWER)
        assert s.response_ids[b + len(text) :] == answer
