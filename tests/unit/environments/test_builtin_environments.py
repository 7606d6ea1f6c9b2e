"""The built-in environments on real sandboxed runs: ``python_tool`` (math) and
``code_feedback`` (code: public tests shown, hidden tests scored)."""

from __future__ import annotations

import pytest

from megatron_rl.data.prompts import Prompt
from megatron_rl.environments.code_feedback import CodeFeedbackEnvironment, public_split
from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.formats import MarkdownFormat, ToolCall
from megatron_rl.environments.protocol import EnvironmentContext, Episode, ToolResult, Turn
from megatron_rl.environments.python_tool import PythonToolEnvironment
from megatron_rl.environments.tools import truncate_to_tokens
from megatron_rl.rewards import RewardPool
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for

REWARD = RewardConfig(kind="math", num_workers=1)
# Start-up of bwrap + Python on the busy 2-core test machine is part of the limit.
TOOL = EnvironmentConfig(name="python_tool", max_tool_output_tokens=40, tool_timeout_s=4.0)


@pytest.fixture(scope="module", autouse=True)
def _box():
    try:
        box_for(REWARD)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")


def _context(tokenizer, config=TOOL, pool=None) -> EnvironmentContext:
    return EnvironmentContext(config, REWARD, tokenizer, max_turns=4, reward_pool=pool)


# ---- truncation by tokens ------------------------------------------------------------------


def test_truncation_keeps_head_and_tail_tokens_and_says_how_many_it_dropped(char_tokenizer):
    text = "".join(chr(ord("a") + i % 26) for i in range(100))  # 100 tokens: one per char
    cut, was_cut = truncate_to_tokens(text, 20, char_tokenizer)
    assert was_cut
    assert cut == text[:10] + "\n[... 80 tokens of output truncated ...]\n" + text[-10:]
    assert truncate_to_tokens(text, 100, char_tokenizer) == (text, False)


# ---- python_tool -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_python_tool_runs_the_code_and_shows_stdout_and_errors(char_tokenizer):
    config = EnvironmentConfig(name="python_tool", max_tool_output_tokens=2000, tool_timeout_s=4.0)
    env = PythonToolEnvironment(_context(char_tokenizer, config))
    env.reset(Prompt(0, "What is 123456789 * 987654321?", answer="121932631112635269"))
    result, done = env.step(ToolCall("print(123456789 * 987654321)\n"))
    assert (result.outcome, result.output, done) == ("ok", "121932631112635269\n", False)
    result, done = env.step(ToolCall("print('a')\n1 / 0\n"))
    assert result.outcome == "error" and not done
    assert result.output.startswith("a\n") and "ZeroDivisionError" in result.output
    # The model's own frame, with its line; none of the sandbox harness's.
    assert 'File "main.py", line 2, in <module>\n    1 / 0\n' in result.output
    assert "<string>" not in result.output


@pytest.mark.timeout(60)
def test_python_tool_cuts_long_output_to_the_token_budget(char_tokenizer):
    env = PythonToolEnvironment(_context(char_tokenizer))
    env.reset(Prompt(0, "q", answer="1"))
    result, _ = env.step(ToolCall("print('x' * 500)\n"))
    # 501 characters (one token each) over a 40-token budget: 20 + marker + 20.
    marker = "\n[... 461 tokens of output truncated ...]\n"
    assert result == ToolResult("truncated", "x" * 20 + marker + "x" * 19 + "\n", result.seconds)


@pytest.mark.timeout(60)
def test_python_tool_reward_is_the_math_reward_of_the_models_text(char_tokenizer):
    fmt = MarkdownFormat()
    with RewardPool(REWARD) as pool:
        env = PythonToolEnvironment(_context(char_tokenizer, pool=pool))
        problem = Prompt(0, "What is 2**70?", answer="1180591620717411303424")
        env.reset(problem)
        turn = "<think>Use the tool.\n```python\nprint(2**70)\n```\n```output"
        call = fmt.parse(turn)
        result, _ = env.step(call)
        assert result.output == "1180591620717411303424\n"
        observation = fmt.observation_text(result.output)
        episode = Episode(problem, [Turn("model", [], turn), Turn("tool", [], observation, result)])
        assert env.reward(episode) == REWARD.incorrect_reward  # no answer from the model yet
        episode.turns.append(Turn("model", [], "</think>\\boxed{1180591620717411303424}"))
        assert env.reward(episode) == REWARD.correct_reward
        episode.turns[-1] = Turn("model", [], "</think>\\boxed{1180591620717411303425}")
        assert env.reward(episode) == REWARD.incorrect_reward


# ---- code_feedback -----------------------------------------------------------------------

# Sum of two numbers, stdin/stdout; 4 tests, the last one only a real solution passes.
TESTS = {
    "tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "10 5\n", "output": "15\n"},
        {"input": "0 0\n", "output": "0\n"},
        {"input": "100 250\n", "output": "350\n"},
    ],
    "fn_name": None,
}
PROBLEM = Prompt(0, "Read two integers, print their sum.", tests=TESTS, domain="code")
CORRECT = "a, b = map(int, input().split())\nprint(a + b)\n"
# Passes the public tests by table look-up, not the hidden one.
MEMORISED = "print({'1 2': 3, '10 5': 15}.get(input().strip(), 0))\n"


def test_public_split_keeps_at_least_one_test_hidden():
    public, hidden = public_split(TESTS, 2)
    assert [t.input for t in public.tests] == ["1 2\n", "10 5\n"]
    assert [t.input for t in hidden.tests] == ["0 0\n", "100 250\n"]
    public, hidden = public_split(TESTS, 10)
    assert len(public.tests) == 3 and len(hidden.tests) == 1
    public, hidden = public_split({"tests": [{"input": "1\n", "output": "1\n"}]}, 3)
    assert public.tests == [] and len(hidden.tests) == 1


@pytest.mark.timeout(90)
def test_code_feedback_shows_public_failures_and_scores_hidden_tests(char_tokenizer):
    config = EnvironmentConfig(
        name="code_feedback", public_tests=2, max_tool_output_tokens=400, tool_timeout_s=4.0
    )
    reward = RewardConfig(kind="code", num_workers=1, code_test_timeout_s=4.0)
    context = EnvironmentContext(config, reward, char_tokenizer, max_turns=3)
    env = CodeFeedbackEnvironment(context)
    assert env.reset(PROBLEM) == PROBLEM.problem
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    result, done = env.step(ToolCall(wrong))
    assert (result.outcome, done) == ("ok", False)
    assert result.output == (
        "Passed 0 of 2 public tests.\n"
        "Test 1: failed\n  input: 1 2\n  expected: 3\n  got: -1\n"
        "Test 2: failed\n  input: 10 5\n  expected: 15\n  got: 5\n"
    )
    result, _ = env.step(ToolCall(MEMORISED))
    assert result.output == "Passed 2 of 2 public tests.\nTest 1: passed\nTest 2: passed\n"

    def final(program: str) -> Episode:
        answer = f"<think>fixed</think>\n```python\n{program}```\n"
        return Episode(PROBLEM, [Turn("model", [], answer)])

    # The reward runs every test: the memorised table fails the hidden one.
    assert env.reward(final(MEMORISED)) == reward.incorrect_reward
    assert env.reward(final(CORRECT)) == reward.correct_reward


@pytest.mark.timeout(90)
def test_code_feedback_reports_crashes_and_timeouts(char_tokenizer):
    config = EnvironmentConfig(name="code_feedback", public_tests=1, tool_timeout_s=2.0)
    context = EnvironmentContext(config, RewardConfig(kind="code"), char_tokenizer, max_turns=3)
    env = CodeFeedbackEnvironment(context)
    env.reset(PROBLEM)
    result, _ = env.step(ToolCall("raise ValueError('bad input')\n"))
    assert result.outcome == "error"
    assert result.output.startswith("Passed 0 of 1 public tests.\nTest 1: error\n")
    assert "ValueError: bad input" in result.output
    result, _ = env.step(ToolCall("while True:\n    pass\n"))
    assert result.outcome == "timeout"
    assert "Test 1: timed out" in result.output and result.seconds < 2.0 + 10
