"""Environments by name (built-ins in code, others by entry point), the protocol's shared
step rules, and the recipe keys (``rollout.max_turns``, ``rollout.environment.*``)."""

from __future__ import annotations

import ast
import importlib.metadata
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.environments import registry
from megatron_rl.environments.code_feedback import CodeFeedbackEnvironment
from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.formats import ToolCall
from megatron_rl.environments.protocol import (
    Environment,
    EnvironmentContext,
    Episode,
    ToolResult,
    Turn,
)
from megatron_rl.environments.python_tool import PythonToolEnvironment
from megatron_rl.rewards.config import RewardConfig

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"


class EchoEnvironment(Environment):
    """A third-party environment for the entry-point test: shows the code back."""

    def run(self, code: str) -> ToolResult:
        return ToolResult("ok", code)


def _with_entry_points(monkeypatch, *points: EntryPoint) -> None:
    def fake(**selection):
        assert selection == {"group": registry.ENTRY_POINT_GROUP}
        return importlib.metadata.EntryPoints(points)

    monkeypatch.setattr(registry, "entry_points", fake)


def test_builtins_are_registered_in_code_and_in_setup_py():
    assert registry.environment_class("python_tool") is PythonToolEnvironment
    assert registry.environment_class("code_feedback") is CodeFeedbackEnvironment
    # setup.py's entry points name the same classes (the installed metadata may be another
    # checkout's, so the source is read).
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    declared = dict(
        (part.strip() for part in line.split("=", 1)) for line in points[registry.ENTRY_POINT_GROUP]
    )
    assert declared == registry.BUILTIN


def test_an_entry_point_adds_an_environment(monkeypatch):
    _with_entry_points(
        monkeypatch, EntryPoint("echo", f"{__name__}:EchoEnvironment", registry.ENTRY_POINT_GROUP)
    )
    assert registry.available() == ["code_feedback", "echo", "python_tool"]
    assert registry.environment_class("echo") is EchoEnvironment
    # and a recipe may name it (with its tool format: the tiny preset's character tokenizer
    # has none for "auto" to find)
    overrides = ["rollout.max_turns=3", "rollout.environment.name=echo"]
    assert load_run_config(TINY, [*overrides, "rollout.environment.tool_format=markdown"])


def test_an_entry_point_cannot_take_a_builtins_name_or_be_anything_else(monkeypatch):
    group = registry.ENTRY_POINT_GROUP
    _with_entry_points(monkeypatch, EntryPoint("python_tool", f"{__name__}:EchoEnvironment", group))
    with pytest.raises(ValueError, match="reuses the name of the built-in"):
        registry.available()
    _with_entry_points(monkeypatch, EntryPoint("bad", f"{__name__}:TINY", group))
    with pytest.raises(TypeError, match="not an Environment subclass"):
        registry.environment_class("bad")
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        registry.environment_class("nope")


def test_recipe_keys_parse_and_bad_ones_name_their_key():
    cfg = load_run_config(TINY)
    assert cfg.rollout.max_turns == 1 and cfg.rollout.environment == EnvironmentConfig()
    cfg = load_run_config(
        TINY,
        [
            "rollout.max_turns=4",
            "rollout.environment.name=python_tool",
            "rollout.environment.tool_format=markdown",
            "rollout.environment.max_tool_output_tokens=64",
            "rollout.environment.tool_timeout_s=2.5",
        ],
    )
    env = cfg.rollout.environment
    assert (cfg.rollout.max_turns, env.name, env.tool_format) == (4, "python_tool", "markdown")
    assert (env.max_tool_output_tokens, env.tool_timeout_s) == (64, 2.5)
    bad = [
        (["rollout.environment.tool_limit=3"], "rollout.environment.tool_limit"),
        (["rollout.max_turns=3"], "rollout.environment.name"),
        (["rollout.environment.name=python_tool"], "rollout.max_turns"),
        (["rollout.max_turns=0"], "rollout.max_turns"),
        (
            ["rollout.max_turns=2", "rollout.environment.name=calculator"],
            "rollout.environment.name",
        ),
        (["rollout.environment.tool_format=hermes"], "rollout.environment.tool_format"),
        (
            ["rollout.environment.max_tool_output_tokens=0"],
            "rollout.environment.max_tool_output_tokens",
        ),
        (["rollout.environment.tool_timeout_s=0"], "rollout.environment.tool_timeout_s"),
        (["rollout.environment.public_tests=-1"], "rollout.environment.public_tests"),
    ]
    for overrides, key in bad:
        with pytest.raises(ConfigError) as err:
            load_run_config(TINY, overrides)
        assert err.value.key == key, (overrides, str(err.value))


def _context(max_turns: int = 3) -> EnvironmentContext:
    return EnvironmentContext(EnvironmentConfig(name="echo"), RewardConfig(), None, max_turns)


class _Problem:
    problem, answer, tests, kind = "What is 6*7?", "42", None, "math"
    reference = "42"


def test_step_reports_malformed_calls_and_the_turn_limit_and_never_raises():
    class Exploding(EchoEnvironment):
        def run(self, code: str) -> ToolResult:
            raise RuntimeError("tool broke")

    env = EchoEnvironment(_context(max_turns=3))
    with pytest.raises(RuntimeError, match="step before reset"):
        env.step(ToolCall("x"))
    assert env.reset(_Problem()) == "What is 6*7?"
    assert env.step(ToolCall(None, "tool call is not valid JSON")) == (
        ToolResult("error", "Error: tool call is not valid JSON"),
        False,
    )
    assert env.step(ToolCall("print(1)")) == (ToolResult("ok", "print(1)"), False)
    result, done = env.step(ToolCall("print(2)"))  # a third call: 3 turns allow 2 calls
    assert (result.outcome, done) == ("error", True) and "no tool calls left" in result.output
    broken = Exploding(_context())
    broken.reset(_Problem())
    assert broken.step(ToolCall("x")) == (
        ToolResult("error", "Error: the tool failed (RuntimeError)"),
        False,
    )


def test_reward_reads_the_models_text_only():
    env = EchoEnvironment(_context())
    env.reset(_Problem())
    # The tool printed a boxed answer; the model never stated one: no reward.
    episode = Episode(
        _Problem(),
        [
            Turn("model", [1], "<think>compute</think>```python\nprint(42)\n```\n```output"),
            Turn("tool", [2], "\n\\boxed{42}\n```\n", ToolResult("ok", "\\boxed{42}")),
            Turn("model", [3], "Done."),
        ],
    )
    request = env.reward_request(episode)
    assert "\\boxed{42}" not in request.response and request.kind == "math"
    assert env.reward(episode) == RewardConfig().incorrect_reward
    episode.turns.append(Turn("model", [4], " So \\boxed{42}."))
    assert env.reward(episode) == RewardConfig().correct_reward


def test_episode_ids_and_mask_follow_the_turns():
    episode = Episode(
        _Problem(),
        [
            Turn("model", [5, 6, 7], "abc"),
            Turn("tool", [8, 9], "de", ToolResult("ok", "d")),
            Turn("model", [10], "f"),
        ],
    )
    assert episode.token_ids() == [5, 6, 7, 8, 9, 10]
    assert episode.loss_mask() == [True, True, True, False, False, True]
    assert episode.tool_results == [ToolResult("ok", "d")]


def test_the_format_calls_the_environments_own_tool(qwen_tokenizer):
    fmt = registry.tool_format(EnvironmentConfig(name="code_feedback"), qwen_tokenizer)
    assert fmt.name == "qwen" and fmt.tool_name == "run_tests"
    ok = '<tool_call>{"name": "run_tests", "arguments": {"code": "print(1)"}}</tool_call>'
    assert fmt.parse(ok).code == "print(1)"
    wrong = ok.replace("run_tests", "python")
    assert fmt.parse(wrong).error == "unknown tool 'python'; the tool is 'run_tests'"
    schema = CodeFeedbackEnvironment.tool_schema()
    assert schema["function"]["name"] == "run_tests"
    assert schema["function"]["parameters"]["required"] == ["code"]
    assert (
        registry.tool_format(EnvironmentConfig(name="python_tool", tool_format="llama3")).name
        == "llama3"
    )
