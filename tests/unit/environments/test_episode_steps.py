"""Issue 38: the engine runner drives environments' tool calls through ``EnvironmentSteps``
(a ``ToolExecutor`` thread per call), token-in / token-out."""

from __future__ import annotations

import math
import queue
from types import SimpleNamespace

import pytest
from support.episode_doubles import Echo, Scripted

from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.episodes import EnvironmentSteps
from megatron_rl.environments.formats import format_for
from megatron_rl.environments.protocol import EnvironmentContext
from megatron_rl.environments.tools import ToolExecutor
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for
from megatron_rl.rollout.engine.runner import EngineRunner
from megatron_rl.rollout.messages import RequestSpec, RunnerSettings, SamplesDone, Stop

REWARD = RewardConfig(kind="math", num_workers=1)


def _python_tool(tok):
    """The llama3 tool format and a python_tool context of 3 turns (skips without a sandbox)."""
    try:
        box_for(REWARD)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")
    fmt = format_for("llama3", tok)
    return fmt, EnvironmentContext(EnvironmentConfig(name="python_tool"), REWARD, tok, max_turns=3)


def test_a_llama3_call_runs_on_the_executor_and_its_output_is_appended_by_id(llama_tokenizer):
    tok = llama_tokenizer
    fmt, context = _python_tool(tok)
    turn1 = tok.encode("x<|python_tag|>print(1)<|eom_id|>", add_special_tokens=False)
    turn2 = tok.encode("ok<|eot_id|>", add_special_tokens=False)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    engine = Scripted([turn1, turn2])
    events = queue.Queue()
    with ToolExecutor(1, REWARD) as executor:
        steps = EnvironmentSteps(
            fmt,
            tok,
            executor,
            lambda: Echo(context),
            max_turns=3,
        )
        runner = EngineRunner(0, engine, RunnerSettings((eot,)), events, steps)
        problem = SimpleNamespace(problem="p")
        runner.submit(RequestSpec(7, 1, (1, 2), 100, 1.0, 1.0, None, problem=problem))
        while runner._tools or engine.has_work():
            runner.step()
    (sample,) = [s for e in list(events.queue) if isinstance(e, SamplesDone) for s in e.samples]
    observation = fmt.observation_ids("8\n", tok)  # len("print(1)")
    assert sample.response_ids == turn1 + observation + turn2
    assert engine.added == [[1, 2], [1, 2, *turn1, *observation]]
    assert sample.mask == [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    assert sample.tools == [("ok", 0.0)] and steps.results == {}  # handed over at the end
    assert sample.finish_reason == "stop"


def test_episode_metrics_count_turns_calls_outcomes_seconds_and_the_tool_token_share():
    from megatron_rl.rollout.samples import TOOL_VERSION as T
    from megatron_rl.rollout.samples import Sample
    from megatron_rl.trainer.scoring import episode_metrics

    three = Sample(0, 0, [1], list(range(9)), [0.0] * 9, [0, 0, T, T, 1, T, 1, 1, 1], [True] * 9)
    three.tools = [("ok", 0.5), ("timeout", 5.0)]
    one = Sample(0, 1, [1], [5, 6, 7], [0.0] * 3, [1, 1, 1], [True] * 3)
    err = Sample(0, 2, [1], [5, 6, T], [0.0] * 3, [1, 1, T], [True] * 3)
    err.tools = [("error", 0.25)]
    metrics = episode_metrics([three, one, err], [1.0, 1.0, 0.0])
    assert metrics["turns_mean"] == (3 + 1 + 1) / 3
    assert metrics["tool_calls"] == 3 and metrics["tool_timeouts"] == 1
    assert metrics["tool_errors"] == 1 and metrics["tool_seconds"] == 5.75
    assert metrics["tool_token_share"] == 4 / 15
    assert metrics["tool_episode_fraction"] == 2 / 3
    assert metrics["pass_rate_with_tool"] == 1 / 2 and metrics["pass_rate_without_tool"] == 1.0
    assert math.isnan(episode_metrics([one], [1.0])["pass_rate_with_tool"])


def test_a_cancelled_prompts_requests_and_episodes_waiting_on_a_tool_are_dropped():
    """``Cancel`` (a validation given up on a stop, issue 49): the runner aborts the
    prompt's requests in the engine and forgets its episodes that wait on a tool call (ended
    in the environment, never continued: the tool's answer is not used); nothing of it is
    sent back, and another prompt's request goes on. Before: the runner had no such command,
    the pass's requests generated to their end."""
    import time

    from support.episode_doubles import SleepyTool

    from megatron_rl.rollout.messages import Cancel

    call = 9
    engine = Scripted([[5, call], [6, 2], [7, 2]])  # 7/0 calls the tool; 7/1 and 8/0 answer
    tools = SleepyTool(call, [40, 41], seconds=0.3)
    events = queue.Queue()
    runner = EngineRunner(0, engine, RunnerSettings((2,)), events, tools)
    problem = SimpleNamespace(problem="p")
    runner.submit(RequestSpec(7, 0, (1,), 20, 1.0, 1.0, None, problem=problem))
    runner.step()  # 7/0's first turn ends on the call: it waits on the tool
    assert len(runner._tools) == 1 and not engine.has_work()
    runner.submit(RequestSpec(7, 1, (1,), 20, 1.0, 1.0))
    runner.submit(RequestSpec(8, 0, (1,), 20, 1.0, 1.0))
    commands = queue.Queue()
    commands.put(Cancel((7,)))
    commands.put(Stop())
    runner.serve(commands, lambda **_: None)  # handles the Cancel, then stops
    assert [t.spec.prompt_index for t in runner.requests.values()] == [8]
    assert tools.ended == [(7, 0)]  # the episode's environment is let go
    time.sleep(0.4)  # the tool's call returns meanwhile: its answer is not used
    while engine.has_work() or runner._tools:
        runner.step()
    sent = [s for e in list(events.queue) if isinstance(e, SamplesDone) for s in e.samples]
    assert [(s.prompt_index, s.sample_index, s.response_ids) for s in sent] == [(8, 0, [7, 2])]
    tools.close()


def test_an_engines_busy_time_leaves_out_its_episodes_waiting_on_a_tool():
    """Issue 49: an episode waiting on its tool call holds a request of the pool but does
    not use the engine; the engine's idle fraction counted it busy. The real pool over a
    runner thread: one episode generates 0.2 s, calls a tool that sleeps 1 s, generates
    0.2 s more. The engine was idle for the tool's call (its measured span, less the
    pool's latency to hear of the call and its return: at most 0.25 s here), and for no
    more than that and the pool's own time to collect the sample. Before: idle ~0."""
    import time

    from support.episode_doubles import RunnerThreads, SleepyTool, Timed

    from megatron_rl.environments.config import EnvironmentConfig
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.pool import GeneratorPool

    call, eos = 9, 2
    tools = SleepyTool(call, [40, 41], seconds=1.0)
    launcher = RunnerThreads(
        lambda: Timed([[5, call], [6, eos]], 0.2), tools, RunnerSettings((eos,))
    )
    config = RolloutConfig(
        engines=1,
        placement="in_process",
        samples_per_prompt=1,
        max_turns=3,
        environment=EnvironmentConfig(name="python_tool", tool_format="markdown"),
    )
    hf = SimpleNamespace(vocab_size=100, eos_token_id=eos)
    with GeneratorPool("unused", config, launcher=launcher, text_config=hf) as pool:
        pool.submit([[1, 3]], seeds=[1], problems=[SimpleNamespace(problem="p")])
        start = time.monotonic()
        pool.reset_engine_load()
        got = []
        while not got:
            got = pool.poll(timeout=5)
        (idle,) = pool.engine_idle_fractions()
        window = time.monotonic() - start
    tools.close()
    (sample,) = got
    assert sample.response_ids == [5, call, 40, 41, 6, eos] and tools.ended == [(0, 0)]
    ((call_start, call_end),) = tools.calls
    on_tool = call_end - call_start  # >= 1.0 s, measured
    latency = 0.25  # the pool hears of the call, and of its return, through the event queue
    assert (on_tool - latency) / window <= idle <= (on_tool + latency) / window, (
        idle,
        on_tool,
        window,
    )


def test_a_cancelled_episodes_tool_call_that_returns_later_leaves_nothing_behind(
    llama_tokenizer, caplog
):
    """``Cancel`` of an episode whose tool call runs (the real ``EnvironmentSteps`` over a
    ``ToolExecutor``): the runner cancels the episode's observation future, which is not
    running (``EnvironmentSteps`` hands out a future of its own, set when the step returns),
    so the cancel succeeds; the call then returns on its tool thread. It must neither raise
    in that thread (before: ``set_result`` on the cancelled future raised
    ``InvalidStateError``, and ``set_exception`` in its handler again: concurrent.futures
    logged 'exception calling callback' for every cancelled episode) nor keep the episode's
    tool results (before: ``results[(7, 0)]`` was left after ``end``, never handed over)."""
    import logging
    import threading

    from megatron_rl.rollout.messages import Cancel

    tok = llama_tokenizer
    fmt, context = _python_tool(tok)
    release = threading.Event()

    class Held(Echo):  # its call returns when the test says so
        def run(self, code):
            release.wait(10)
            return super().run(code)

    turn1 = tok.encode("x<|python_tag|>print(1)<|eom_id|>", add_special_tokens=False)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    engine = Scripted([turn1])
    events = queue.Queue()
    caplog.set_level(logging.ERROR, logger="concurrent.futures")
    with ToolExecutor(1, REWARD) as executor:
        steps = EnvironmentSteps(fmt, tok, executor, lambda: Held(context), max_turns=3)
        runner = EngineRunner(0, engine, RunnerSettings((eot,)), events, steps)
        problem = SimpleNamespace(problem="p")
        runner.submit(RequestSpec(7, 0, (1, 2), 100, 1.0, 1.0, None, problem=problem))
        runner.step()  # the turn ends on the call: the episode waits on its tool
        (observation,) = runner._tools
        assert not observation.running() and not observation.done()
        commands = queue.Queue()
        commands.put(Cancel((7,)))
        commands.put(Stop())
        runner.serve(commands, lambda **_: None)
        assert runner._tools == {} and runner.requests == {}
        release.set()  # the call returns now, on its tool thread
        executor.close()  # waits for the call's end...
        executor._executor.shutdown(wait=True)  # ...and its thread's, done callbacks included
    errors = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert errors == [], [r.getMessage() for r in errors]
    assert steps.results == {} and steps._environments == {}
    assert not [s for e in list(events.queue) if isinstance(e, SamplesDone) for s in e.samples]
