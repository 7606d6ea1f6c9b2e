"""Issue 38 on the real engine: a multi-turn episode through vLLM (CPU build), the real
sandboxed ``python_tool`` and the markdown tool format, token-in / token-out.

The tiny model is made to write one tool-using trace (a few hundred SGD steps on it from a
random init, here): greedy decoding then asks the tool, and what follows the tool's output is
the model's. The engine stops on the format's stop string through vLLM's own detokenizer.
"""

from __future__ import annotations

import queue

import pytest

PROBLEM = "6*7"
# The model's part of the trace; the tool's output block comes between the two turns.
TURN1 = "<think>```python\nprint(6*7)\n```\n```output"
TURN2 = "</think>\\boxed{42}"


def _memorize(hf_dir: str, tokenizer, sequence: list[int]) -> None:
    """Train ``hf_dir``'s model (in place) until greedy decoding reproduces ``sequence``."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = torch.tensor([sequence])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        logits = model(ids).logits[0, :-1]
        if bool((logits.argmax(-1) == ids[0, 1:]).all()):
            break
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert bool((model(ids).logits[0, :-1].argmax(-1) == ids[0, 1:]).all()), "not memorized"
    model.save_pretrained(hf_dir)


@pytest.mark.timeout(600)  # ~40 s here
def test_a_real_engine_episode_calls_the_sandboxed_tool_and_continues_from_ids(tmp_path):
    from megatron_rl.data.prompts import Prompt
    from megatron_rl.data.synthetic import make_problem
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.environments.config import EnvironmentConfig
    from megatron_rl.environments.formats import format_for
    from megatron_rl.models import make_hf_model, preset_hf_config
    from megatron_rl.rewards import math as math_reward
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.runner import EngineRunner, build_episodes
    from megatron_rl.rollout.engine.vllm_engine import VLLMEngine
    from megatron_rl.rollout.messages import RequestSpec, RunnerSettings, SamplesDone
    from megatron_rl.rollout.samples import TOOL_VERSION
    from megatron_rl.trainer.scoring import model_text

    sandbox = RewardConfig(kind="math", num_workers=1)
    try:
        box_for(sandbox)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")
    tok = build_char_tokenizer(tmp_path / "tok")
    hf_dir = make_hf_model(
        preset_hf_config("tiny-llama"),
        str(tmp_path / "hf"),
        seed=0,
        tokenizer_dir=str(tmp_path / "tok"),
    )
    fmt = format_for("markdown")
    observation = fmt.observation_ids("42\n", tok)  # what the tool will print, rendered
    prompt = tok(PROBLEM)["input_ids"]
    turn1, turn2 = (tok.encode(t, add_special_tokens=False) for t in (TURN1, TURN2))
    _memorize(hf_dir, tok, prompt + turn1 + observation + turn2 + [tok.eos_token_id])
    # the data module's worked trace is the same text: the tiny tool recipe warm-starts on it
    solution = make_problem(6, 7, "mul", solution="tool")["solution"]
    assert solution == TURN1 + tok.decode(observation) + TURN2

    config = RolloutConfig(
        dtype="float32",
        max_tokens=80,
        max_model_len=128,
        stop_token_ids=[tok.eos_token_id],
        max_turns=2,
        environment=EnvironmentConfig(name="python_tool", tool_format="markdown"),
    )
    settings = RunnerSettings((tok.eos_token_id,), sandbox=sandbox)
    episodes = build_episodes(hf_dir, config, settings)
    engine = VLLMEngine(hf_dir, config)
    added, produced = [], {}
    add, step = engine.add, engine.step

    def recording_add(request_id, prompt_ids, *args, **kwargs):
        added.append((request_id, list(prompt_ids), kwargs.get("stop_strings", ())))
        add(request_id, prompt_ids, *args, **kwargs)

    def recording_step():
        deltas = step()
        for delta in deltas:
            produced.setdefault(delta.request_id, []).extend(delta.token_ids)
        return deltas

    engine.add, engine.step = recording_add, recording_step
    events = queue.Queue()
    try:
        runner = EngineRunner(0, engine, settings, events, episodes)
        problem = Prompt(0, PROBLEM, answer="42")
        runner.submit(RequestSpec(0, 0, tuple(prompt), 80, 0.0, 1.0, None, 7, problem))
        while runner._tools or engine.has_work():
            runner.step()
    finally:
        engine.close()
        episodes.close()
    (sample,) = [s for e in list(events.queue) if isinstance(e, SamplesDone) for s in e.samples]

    # two requests: the second is the first's ids, the tool's ids, from ids (no re-tokenizing)
    assert [a[2] for a in added] == [("```output",)] * 2
    first, second = (produced[a[0]] for a in added)
    assert first == turn1  # vLLM stopped at the stop string and kept it
    assert added[1][1] == prompt + first + observation
    assert sample.response_ids == first + observation + second
    assert second == turn2 + [tok.eos_token_id]
    assert sample.mask == [True] * len(first) + [False] * len(observation) + [True] * len(second)
    assert sample.versions == [0] * len(first) + [TOOL_VERSION] * len(observation) + [0] * len(
        second
    )
    assert all(lp == 0.0 for lp in sample.logprobs[len(first) : len(first) + len(observation)])
    assert [outcome for outcome, _ in sample.tools] == ["ok"] and sample.tools[0][1] > 0
    assert sample.finish_reason == "stop"
    # the reward reads the model's text only, and it answers
    text = model_text(tok, sample)
    assert "42\n```" not in text and text.endswith("\\boxed{42}")
    assert math_reward.score(text, "42") == 1.0
