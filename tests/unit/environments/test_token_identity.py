"""Token identity of an episode under real BPE (issue 46, section 2).

With the character tokenizer, decoding ids and encoding the text again gives the same ids,
so the episode tests cannot tell an episode kept by id from one re-tokenized on the way. Here
the tokenizer is Meta's Llama-3.1 BPE and the model's turn is a non-canonical tokenization of
its text (``pr`` + ``int`` where encoding the text gives ``print``): the sample, and the
context the engine continues from, must hold the engine's ids as they came, then the tool's
observation tokenized once on its own.

How this was checked to fail under re-tokenization (each mutation applied by hand, the test
run, the mutation reverted; the character-tokenizer test_episode_steps.py passed under both):
(1) ``rollout/engine/runner.py``, ``_continue_episodes``: the next turn's context
re-tokenized, ``tok.encode(tok.decode(sample.prompt_ids + sample.response_ids,
skip_special_tokens=False), add_special_tokens=False)``: fails on ``engine.added`` (one
``print`` where the model wrote ``pr`` + ``int``); (2) ``environments/episodes.py``,
``tool_step``: the tool's output re-tokenized together with the model's turn, the
observation being the ids past ``len(turn_ids)`` of ``tok.encode(tok.decode(turn_ids) +
fmt.observation_text(output))``: fails on ``response_ids``.
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

from support.episode_doubles import Echo, Scripted

from megatron_rl.data import DataConfig, encode_prompt
from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.episodes import EnvironmentSteps
from megatron_rl.environments.formats import format_for
from megatron_rl.environments.protocol import EnvironmentContext
from megatron_rl.environments.tools import ToolExecutor
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.engine.runner import EngineRunner
from megatron_rl.rollout.messages import RequestSpec, RunnerSettings, SamplesDone

REWARD = RewardConfig(kind="math", num_workers=1)


def test_an_episode_keeps_a_non_canonical_model_turn_by_id(llama31_tokenizer):
    tok = llama31_tokenizer
    special = tok.convert_tokens_to_ids
    words = tok.convert_tokens_to_ids(["pr", "int"])
    # "I'll run it." <|python_tag|> pr int (1) <|eom_id|>: the text encodes "print" as one token
    head = tok.encode("I'll run it.", add_special_tokens=False)
    tail = tok.encode("(1)", add_special_tokens=False)
    turn1 = head + [special("<|python_tag|>")] + words + tail + [special("<|eom_id|>")]
    text1 = tok.decode(turn1, skip_special_tokens=False)
    assert text1 == "I'll run it.<|python_tag|>print(1)<|eom_id|>"
    assert tok.encode(text1, add_special_tokens=False) != turn1  # the premise: non-canonical
    turn2 = tok.encode("It printed 8.", add_special_tokens=False) + [special("<|eot_id|>")]
    fmt = format_for("llama3", tok)
    tools = fmt.template_kwargs({})
    prompt = encode_prompt("2+2", DataConfig(), tok, tools)[1]
    assert prompt.count(128000) == 1

    context = EnvironmentContext(EnvironmentConfig(name="python_tool"), REWARD, tok, max_turns=3)
    engine = Scripted([turn1, turn2], max_model_len=4096)
    events = queue.Queue()
    with ToolExecutor(1, REWARD) as executor:
        steps = EnvironmentSteps(fmt, tok, executor, lambda: Echo(context), max_turns=3)
        runner = EngineRunner(0, engine, RunnerSettings((special("<|eot_id|>"),)), events, steps)
        spec = RequestSpec(
            0, 1, tuple(prompt), 200, 1.0, 1.0, None, problem=SimpleNamespace(problem="p")
        )
        runner.submit(spec)
        while runner._tools or engine.has_work():
            runner.step()
    (sample,) = [s for e in list(events.queue) if isinstance(e, SamplesDone) for s in e.samples]
    # Echo's output for "print(1)": "8\n", in an ipython turn, then the assistant header, as
    # Meta's formatter writes them (tested against it in test_llama_tool_turns.py)
    observation = (
        [special("<|start_header_id|>")]
        + tok.encode("ipython", add_special_tokens=False)
        + [special("<|end_header_id|>")]
        + tok.encode("\n\n", add_special_tokens=False)
        + tok.encode("8\n", add_special_tokens=False)
        + [special("<|eot_id|>"), special("<|start_header_id|>")]
        + tok.encode("assistant", add_special_tokens=False)
        + [special("<|end_header_id|>")]
        + tok.encode("\n\n", add_special_tokens=False)
    )
    assert sample.response_ids == turn1 + observation + turn2
    assert engine.added == [prompt, prompt + turn1 + observation]
    assert sample.mask == [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    assert sample.finish_reason == "stop"
