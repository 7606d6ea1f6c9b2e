"""Code reward: test parsing, output comparison, scoring (hostile programs: test_rewards_sandbox)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards import code as code_reward
from megatron_rl.rewards.code import CodeTest, outputs_match, parse_tests, values_match
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for
from megatron_rl.rewards.pool import count_timeouts
from megatron_rl.rewards.sandbox import run_program

# 3 s of CPU time per test; a wall-clock backstop of 6 s (neither counts starting the box).
CONFIG = RewardConfig(
    kind="code",
    code_test_timeout_s=3.0,
    code_wall_timeout_s=6.0,
    code_memory_mb=512,
    num_workers=2,
)

ADD_TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"}]
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(autouse=True)
def _sandbox():
    try:
        box_for(CONFIG)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")


def respond(program: str) -> str:
    return f"<think>plan</think>Here it is:\n```python\n{program}```\n"


@pytest.mark.timeout(30)
def test_correct_program_passes_all_tests():
    assert code_reward.score_code(respond(ADD_PROGRAM), ADD_TESTS, CONFIG) == 1.0


@pytest.mark.timeout(30)
def test_wrong_or_missing_program_fails():
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    assert code_reward.score_code(respond(wrong), ADD_TESTS, CONFIG) == -1.0
    assert code_reward.score_code("<think>x</think> no code", ADD_TESTS, CONFIG) == -1.0
    # The program sits inside an unclosed thinking section: no answer.
    assert code_reward.score_code(f"<think>```python\n{ADD_PROGRAM}```", ADD_TESTS, CONFIG) == -1.0


@pytest.mark.timeout(30)
def test_functional_tests_call_the_named_function():
    program = "class Solution:\n    def twoSum(self, a, b):\n        return [a, b + 1]\n"
    lcb = [{"input": "1\n2", "output": "[1, 3]", "testtype": "functional"}]
    tests = {"tests": json.dumps(lcb), "fn_name": "twoSum"}
    assert code_reward.score_code(respond(program), tests, CONFIG) == 1.0
    taco = {"inputs": [[1, 2]], "outputs": [[[1, 3]]], "fn_name": "twoSum"}
    assert code_reward.score_code(respond(program), taco, CONFIG) == 1.0
    plain = "def f(x):\n    return x * 2\n"
    assert (
        code_reward.score_code(
            respond(plain), {"tests": {"inputs": [[4]], "outputs": [8]}, "fn_name": "f"}, CONFIG
        )
        == 1.0
    )


def test_parse_tests_formats():
    canonical = [CodeTest("1\n", "2\n")]
    assert parse_tests([{"input": "1\n", "output": "2\n"}]) == canonical
    assert parse_tests(json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})) == canonical
    lcb = [
        {"input": "[1]\n2", "output": "3", "testtype": "functional", "metadata": {"func_name": "g"}}
    ]
    assert parse_tests(lcb) == [CodeTest("[[1], 2]", "3", "g")]
    with pytest.raises(ValueError):
        parse_tests("not json")
    with pytest.raises(ValueError):
        parse_tests([{"input": "1"}])
    with pytest.raises(ValueError):
        parse_tests([{"input": "1", "output": "2", "testtype": "functional"}])


def test_output_comparison():
    assert outputs_match("1 2\n3  \n\n", "1 2\n3")
    assert outputs_match("0.3333333\n", "0.33333333")
    assert not outputs_match("1 2", "1 3")
    assert values_match([1, 2.0000001], [1, 2.0])
    assert not values_match([1, 2.0000001], [1, 2])  # an integer answer is exact
    assert values_match(5, [5], match="equal_or_only_element")
    assert not values_match(5, [5])
    assert not values_match(True, 1)


@pytest.mark.timeout(30)
def test_programs_may_use_their_own_scratch_space():
    program = (
        "import tempfile\nopen('scratch.txt', 'w').write('x')\n"
        "with tempfile.NamedTemporaryFile('w+') as f:\n    f.write('y')\n    f.seek(0)\n"
        "    print(open('scratch.txt').read() + f.read())\n"
    )
    result = run_program(program, "", CONFIG)
    assert result.status == "ok" and result.stdout.strip() == "xy", result


@pytest.mark.timeout(30)
def test_a_hanging_program_times_out():
    # 1 s of CPU time; the wall-clock backstop far enough that a loaded machine reaches it.
    config = dataclasses.replace(CONFIG, code_wall_timeout_s=30.0)
    result = run_program("while True:\n    pass\n", "", config, timeout_s=1.0)
    assert result.status == "timeout_cpu"
    assert 1.0 <= result.elapsed_s < 30.0


@pytest.mark.timeout(30)
def test_reward_pool_scores_code_in_parallel():
    wrong = "print(0)\n"
    with RewardPool(CONFIG) as pool:
        rewards = pool.score_batch(
            [respond(ADD_PROGRAM), respond(wrong), respond("while True:\n    pass\n")],
            [ADD_TESTS] * 3,
        )
        mixed = pool.score_batch(
            [respond(ADD_PROGRAM), "</think>\\boxed{4}"], [ADD_TESTS, "4"], kinds=["code", "math"]
        )
    assert rewards == [1.0, -1.0, -1.0]
    assert mixed == [1.0, 1.0]


# --- Issue 28, code items 6-8: round trip of every format, literals, comparison options. ---

# One problem per format the loaders accept, written as the public datasets store them,
# with the calls each functional test must make (written out by hand) and a gold program.
TWO_SUM = (
    "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
    "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
    "                return [seen[target - x], i]\n            seen[x] = i\n"
)
SUM_STDIN = "n = int(input())\nprint(sum(map(int, input().split()[:n])))\n"
DIGITAL_ROOT = (
    "def digital_root(n):\n    return n if n < 10 else digital_root(sum(map(int, str(n))))\n"
)
ADD = "def add(a, b):\n    return a + b\n"
# name -> (tests as stored, the argument lists of its functional tests or None, gold program)
FORMATS: dict[str, tuple[object, list | None, str]] = {
    "canonical stdin": ([{"input": "3\n1 2 3\n", "output": "6\n"}], None, SUM_STDIN),
    "canonical functional (issue example)": (
        [{"input": "[1, 2]", "output": "3", "fn_name": "add"}],
        [[1, 2]],
        ADD,
    ),
    "canonical functional, one list argument": (
        [{"input": "[[1, 2], [3]]", "output": "[1, 2, 3]", "fn_name": "add"}],
        [[[1, 2], [3]]],
        ADD,
    ),
    "canonical functional, one argument per line (no testtype)": (
        [{"input": "[1, 2]\n[3]", "output": "[1, 2, 3]", "fn_name": "add"}],
        [[[1, 2], [3]]],
        ADD,
    ),
    "canonical python literals": (
        [
            {
                "input": "[(1, 2), (3,)]",
                "output": "(1, 2, 3)",
                "fn_name": "add",
                "encoding": "python",
            }
        ],
        [[(1, 2), (3,)]],
        ADD,
    ),
    "LiveCodeBench functional": (
        json.dumps(
            [
                {
                    "input": "[2, 7, 11, 15]\n9",
                    "output": "[0, 1]",
                    "testtype": "functional",
                    "metadata": {"func_name": "twoSum"},
                },
                {
                    "input": "[3, 2, 4]\n6",
                    "output": "[1, 2]",
                    "testtype": "functional",
                    "metadata": {"func_name": "twoSum"},
                },
            ]
        ),
        [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
        TWO_SUM,
    ),
    "LiveCodeBench stdin": (
        [{"input": "2\n5 6\n", "output": "11\n", "testtype": "stdin", "metadata": {}}],
        None,
        SUM_STDIN,
    ),
    "PrimeIntellect function_call": (
        [{"type": "function_call", "fn_name": "add", "input": [[1], [2]], "output": [[1, 2]]}],
        [[[1], [2]]],
        ADD,
    ),
    "PrimeIntellect stdin_stdout": (
        [{"type": "stdin_stdout", "input": "1\n41\n", "output": "41\n"}],
        None,
        SUM_STDIN,
    ),
    "TACO call_based": (
        json.dumps({"fn_name": "digital_root", "inputs": [[16], [942]], "outputs": [[7], [6]]}),
        [[16], [942]],
        DIGITAL_ROOT,
    ),
    "APPS stdin columns": (
        {"inputs": ["2\n1 1\n", ["3", "1 2 3"]], "outputs": ["2\n", ["6"]]},
        None,
        SUM_STDIN,
    ),
    "loader wrapper (DeepCoder row, fn_name from metadata)": (
        {
            "tests": json.dumps(
                [{"input": "[4]\n[5]", "output": "[4, 5]", "testtype": "functional"}]
            ),
            "fn_name": "add",
        },
        [[[4], [5]]],
        ADD,
    ),
    "MBPP asserts": (
        ["assert add((1, 2), (3,)) == (1, 2, 3)", "assert add('a', 'b') == 'ab'"],
        [[(1, 2), (3,)], ["a", "b"]],
        ADD,
    ),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_round_trips_to_the_same_calls(name):
    stored, calls, _ = FORMATS[name]
    cases = parse_tests(stored)
    again = parse_tests([case.to_dict() for case in cases])
    assert again == cases
    assert parse_tests(json.dumps([case.to_dict() for case in cases])) == cases
    if calls is None:
        assert all(case.fn_name is None for case in cases)
    else:
        assert [case.arguments() for case in again] == calls
        assert [type(a) for case in again for a in case.arguments()] == [
            type(a) for call in calls for a in call
        ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_gold_programs_pass_before_and_after_the_round_trip(name):
    stored, _, gold = FORMATS[name]
    problem = code_reward.parse_problem(stored)
    canonical = problem.to_dict()
    assert code_reward.parse_problem(canonical) == problem
    for tests in (stored, canonical, json.dumps(canonical)):
        assert code_reward.score_code(respond(gold), tests, CONFIG) == 1.0
    wrong = gold.replace("return", "return None and", 1) if "return" in gold else "print(0)\n"
    assert code_reward.score_code(respond(wrong), canonical, CONFIG) == -1.0


# MBPP-style problems of our own, in MBPP's public row format (the reward reads test_list).
MBPP_ROWS = [
    {
        "task_id": 9001,
        "text": "Write a function to return the minimum and maximum of a list as a tuple.",
        "code": "def min_max(xs):\n    return (min(xs), max(xs))",
        "test_list": [
            "assert min_max([3, 1, 2]) == (1, 3)",
            "assert min_max([5]) == (5, 5)",
            "assert min_max([-2, 7, 0]) == (-2, 7)",
        ],
        "wrong": "def min_max(xs):\n    return [min(xs), max(xs)]",
    },
    {
        "task_id": 9002,
        "text": "Write a function to count unordered pairs, keyed by the sorted pair.",
        "code": "def pair_counts(pairs):\n    counts = {}\n    for p in pairs:\n"
        "        key = tuple(sorted(p))\n        counts[key] = counts.get(key, 0) + 1\n"
        "    return counts",
        "test_list": [
            "assert pair_counts([(1, 2), (2, 1), (3, 4)]) == {(1, 2): 2, (3, 4): 1}",
            "assert pair_counts([]) == {}",
        ],
        "wrong": "def pair_counts(pairs):\n    return {str(p): 1 for p in pairs}",
    },
    {
        "task_id": 9003,
        "text": "Write a function to find the area of a circle.",
        "code": "def circle_area(r):\n    return 3.1416 * r * r",
        "test_list": [
            "assert math.isclose(circle_area(10), 314.15926535897933, rel_tol=0.001)",
            "assert math.isclose(circle_area(1), 3.141592653589793, rel_tol=0.001)",
        ],
        "wrong": "def circle_area(r):\n    return 3.2 * r * r",
    },
    {
        "task_id": 9004,
        "text": "Write a function to check whether a value is a tuple of integers.",
        "code": "def is_int_tuple(x):\n    return isinstance(x, tuple) and all(isinstance(v, int) for v in x)",
        "test_list": [
            "assert is_int_tuple((1, 2)) == True",
            "assert not is_int_tuple([1, 2])",
            "assert is_int_tuple(()) is True",
            "assert is_int_tuple((1, 'a')) == False",
        ],
        "wrong": "def is_int_tuple(x):\n    return all(isinstance(v, int) for v in x)",
    },
    {
        "task_id": 9005,
        "text": "Write a function to find the common elements of two lists as a set.",
        "code": "def common(a, b):\n    return set(a) & set(b)",
        "test_list": [
            "assert common([1, 2, 3], [2, 3, 4]) == {2, 3}",
            "assert common([1], [2]) == set()",
        ],
        "wrong": "def common(a, b):\n    return sorted(set(a) & set(b))",
    },
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", MBPP_ROWS, ids=lambda r: str(r["task_id"]))
def test_mbpp_gold_programs_pass_and_wrong_ones_fail(row):
    gold, wrong = respond(row["code"] + "\n"), respond(row["wrong"] + "\n")
    assert code_reward.score_code(gold, row["test_list"], CONFIG) == 1.0
    assert code_reward.score_code(wrong, row["test_list"], CONFIG) == -1.0
    canonical = code_reward.parse_problem(row["test_list"]).to_dict()
    assert code_reward.score_code(gold, json.dumps(canonical), CONFIG) == 1.0


def test_mbpp_asserts_that_are_not_literal_calls_are_refused_by_line():
    with pytest.raises(ValueError, match="unsupported assert"):
        parse_tests(["assert common([1], [1]) < 2"])
    with pytest.raises(ValueError, match="not a literal in 'assert set"):
        parse_tests(["assert set(common([1], [1])) == set([1])"])
    with pytest.raises(ValueError, match="not a literal"):
        parse_tests(["assert f(__import__('os').getcwd()) == 1"])
    with pytest.raises(ValueError, match="not an assert"):
        parse_tests(["print(f(1))"])
    problem = code_reward.parse_problem(MBPP_ROWS[2]["test_list"])
    tolerance = problem.tests[0].options(problem.compare)  # each isclose line its own
    assert tolerance.float_rel_tol == 0.001 and tolerance.float_abs_tol == 0.0


def test_python_literals_carry_tuples_sets_and_keys_both_ways_without_eval():
    from megatron_rl.rewards import literals

    for value in [
        (1,),
        {(1, 2): frozenset({3})},
        [b"x", 1j, None, True, -0.5, float("inf"), -float("inf")],
        {"a": {1: (2, [3])}},
        set(),
        2**200,
    ]:
        text = literals.encode(value)
        assert literals.decode(text) == value and type(literals.decode(text)) is type(value)
    assert literals.decode(literals.encode(frozenset({1}))) == {1}
    with pytest.raises(ValueError):
        literals.encode(float("nan"))
    with pytest.raises(ValueError):
        literals.encode(object())
    with pytest.raises(ValueError):
        literals.decode("__import__('os').system('true')")
    with pytest.raises(ValueError):
        literals.decode("[" * 5000 + "]" * 5000)


@pytest.mark.timeout(60)
def test_functional_results_keep_their_python_types():
    def problem(expected: str) -> list[dict]:
        return [{"input": "[(1, 2)]", "output": expected, "fn_name": "f", "encoding": "python"}]

    returns_arg = respond("def f(x):\n    return {x: isinstance(x, tuple)}\n")
    # The tuple argument arrives as a tuple; the tuple-keyed dict comes back intact.
    assert code_reward.score_code(returns_arg, problem("{(1, 2): True}"), CONFIG) == 1.0
    assert code_reward.score_code(returns_arg, problem("{(1, 2): False}"), CONFIG) == -1.0
    returns_list = respond("def f(x):\n    return list(x)\n")
    assert code_reward.score_code(returns_list, problem("(1, 2)"), CONFIG) == -1.0
    assert code_reward.score_code(returns_list, problem("[1, 2]"), CONFIG) == 1.0
    # JSON test data keeps its old meaning: a returned tuple matches an expected array, and a
    # value with no JSON form fails (it used to crash the harness) instead of erroring.
    json_tests = {"inputs": [[[1, 2]]], "outputs": [[1, 2]], "fn_name": "f"}
    assert (
        code_reward.score_code(respond("def f(x):\n    return tuple(x)\n"), json_tests, CONFIG)
        == 1.0
    )
    assert code_reward.score_code(returns_arg, json_tests, CONFIG) == -1.0
    # A value with no literal (an object of the program's own class) is a wrong answer.
    own = respond("class P:\n    pass\ndef f(x):\n    return P()\n")
    assert code_reward.score_code(own, problem("None"), CONFIG) == -1.0


def test_comparison_options():
    from megatron_rl.rewards.code import CompareOptions

    default = CompareOptions()
    icpc = CompareOptions(case_sensitive=False)
    assert not outputs_match("Possible\n", "possible\n", default)
    assert outputs_match("Possible\n", "possible\n", icpc)
    assert outputs_match("1 2\n3\n", "1\n2 3", default)  # tokens: any whitespace
    assert not outputs_match("1 2\n3\n", "1\n2 3", CompareOptions(whitespace="lines"))
    assert outputs_match("1  2 \n3\n\n", "1 2\n3", CompareOptions(whitespace="lines"))
    assert not outputs_match("1 2 \n", "1 2\n", CompareOptions(whitespace="exact"))
    assert outputs_match("1 2\n", "1 2", CompareOptions(whitespace="exact"))
    # Float tolerance: 314.16 vs pi * 100 is 2.3e-6 off (relative).
    assert not outputs_match("314.16", "314.159265", default)
    assert outputs_match("314.16", "314.159265", CompareOptions(float_rel_tol=1e-3))
    assert outputs_match(
        "314.16", "314.159265", CompareOptions(float_abs_tol=1e-3, float_rel_tol=0)
    )
    assert not outputs_match("1.0001", "1", CompareOptions(float_abs_tol=0, float_rel_tol=0))
    assert values_match(314.16, 314.159265, CompareOptions(float_rel_tol=1e-3))
    assert not values_match(314.16, 314.159265, default)
    with pytest.raises(ValueError, match="unknown keys \\['case'\\]"):
        CompareOptions.from_dict({"case": False})
    with pytest.raises(ValueError, match="compare.whitespace"):
        CompareOptions.from_dict({"whitespace": "any"})
    with pytest.raises(ValueError, match="compare.float_rel_tol"):
        CompareOptions.from_dict({"float_rel_tol": -1})


@pytest.mark.timeout(60)
def test_per_problem_options_in_the_test_data():
    program = respond("print('Possible')\n")
    tests = [{"input": "", "output": "possible"}]
    assert code_reward.score_code(program, tests, CONFIG) == -1.0
    icpc = {"tests": tests, "compare": {"case_sensitive": False}}
    assert code_reward.score_code(program, icpc, CONFIG) == 1.0
    assert code_reward.score_code(program, json.dumps(icpc), CONFIG) == 1.0
    # The loaders' wrapper around a tests dict that carries the options.
    wrapped = {"tests": json.dumps(icpc), "fn_name": None}
    assert code_reward.score_code(program, wrapped, CONFIG) == 1.0


def test_special_judge_problems_are_refused_not_scored_wrong():
    from megatron_rl.rewards.code import SpecialJudgeError, needs_special_judge

    spj = {"inputs": ["4\n"], "outputs": ["1 3\n"], "special_judge": True}
    loader = {"tests": json.dumps(spj), "fn_name": None}
    assert needs_special_judge(loader) and needs_special_judge(json.dumps(spj))
    assert not needs_special_judge({"tests": json.dumps(ADD_TESTS), "fn_name": None})
    with pytest.raises(SpecialJudgeError):
        code_reward.score_code(respond("print(3, 1)\n"), loader, CONFIG)
    with pytest.raises(SpecialJudgeError):
        parse_tests({"tests": [{"input": "", "output": "1"}], "checker": "checker.py"})


# --- Issue 37 item 9: a verdict that does not depend on the load on the machine. ---

# Spends 0.5 s of its own CPU time (not wall-clock time: the same work alone and under load),
# then answers.
BURN_HALF_SECOND = (
    "import time\nstart = time.process_time()\n"
    "while time.process_time() - start < 0.5:\n    pass\n"
    "a, b = map(int, input().split())\nprint(a + b)\n"
)


@contextlib.contextmanager
def _burners_on_one_core(count: int):
    """``count`` processes spinning on the core this thread is moved to (its children, the
    sandboxes, start there too): each program then gets about 1 / (count + 1) of a core."""
    core = min(os.sched_getaffinity(0))
    previous = os.sched_getaffinity(0)
    spin = (
        f"import os\nos.sched_setaffinity(0, {{{core}}})\nprint('spinning', flush=True)\n"
        "while True:\n    pass\n"
    )
    burners = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for burner in burners:  # on a loaded machine an interpreter takes a while to start
        assert burner.stdout.readline().strip() == "spinning"
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)
        for burner in burners:
            burner.kill()
            burner.wait()


@pytest.mark.timeout(60)
def test_code_verdicts_do_not_depend_on_load():
    # 1 s of CPU time per test; the wall-clock backstop generous (the test shares the core).
    config = dataclasses.replace(CONFIG, code_test_timeout_s=1.0, code_wall_timeout_s=30.0)
    tests = [{"input": "3 4\n", "output": "7\n"}]
    alone = code_reward.code_outcome(respond(BURN_HALF_SECOND), tests, config)
    with _burners_on_one_core(3):
        loaded = code_reward.code_outcome(respond(BURN_HALF_SECOND), tests, config)
    assert alone.status == loaded.status == code_reward.CORRECT, (alone, loaded)
    # Under load its 0.5 s of CPU took well over 0.5 s of wall-clock time (a wall-clock limit
    # at the CPU time would have failed it), and the start of its box counted in neither. (Its
    # share of the core varies with the machine's scheduler: 0.86 s to over 2 s were seen.)
    assert loaded.wall_s > 1.3 * loaded.cpu_s, loaded
    assert 0.45 <= alone.cpu_s < 0.9 and 0.45 <= loaded.cpu_s < 0.9, (alone, loaded)
    # Past the CPU-time limit: a verdict (too slow), not a wall-clock timeout.
    spin = code_reward.code_outcome(respond("while True:\n    pass\n"), tests, config)
    assert spin.status == code_reward.TIMEOUT_CPU, spin
    # Killed by its timer at 1 s of CPU time, by the kernel's count.
    assert 0.9 <= spin.cpu_s < 1.5 and 1.0 <= spin.wall_s < 30.0, spin
    # Waiting spends no CPU time: the wall-clock backstop ends it, reported as its own status.
    config = dataclasses.replace(config, code_wall_timeout_s=1.5)
    with RewardPool(config) as pool:
        rewards = pool.score_batch(
            [respond("import time\ntime.sleep(30)\n"), respond(ADD_PROGRAM)], [tests] * 2
        )
        statuses = pool.last_statuses
    assert rewards == [config.incorrect_reward, config.correct_reward]
    assert statuses == [code_reward.TIMEOUT_WALL, code_reward.CORRECT]
    assert count_timeouts(statuses) == {"timeouts": 1, "timeouts_wall": 1}


def test_the_wall_clock_backstop_is_a_recipe_key_at_least_the_cpu_limit():
    from pathlib import Path

    from megatron_rl.config import ConfigError, load_run_config

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny_cpu.yaml"
    config = load_run_config(recipe, ["reward.code_wall_timeout_s=45"])
    assert config.reward.code_wall_timeout_s == 45
    with pytest.raises(ConfigError, match="reward.code_wall_timeout_s"):
        load_run_config(recipe, ["reward.code_test_timeout_s=20", "reward.code_wall_timeout_s=10"])


# --- Issue 45: code comparisons (exact integers, no Python-only numbers, the dataset's own
# rules), no crash on any returned value, and the block that is graded. ---


def test_integers_compare_exactly_and_a_tolerance_is_the_references():
    # An off-by-one on a big integer passed under the float tolerance (rel 1e-6).
    assert not outputs_match("1000000008\n", "1000000007\n")
    assert not values_match(1000000008, 1000000007)
    assert not values_match(1000000008, 1000000007, encoding="python")
    assert not outputs_match("5.0000001", "5")
    # Controls: the same value in the forms programs print it.
    assert outputs_match("1000000007\n", "1000000007")
    assert outputs_match("5.0", "5") and outputs_match("-0", "0") and outputs_match("007", "7")
    assert values_match(1000000007, 1000000007) and values_match(5.0, 5)
    # An inexact expected value keeps its tolerance (here 1e-6 relative to 2.0: 2e-6).
    assert values_match(1.9999985, 2.0) and not values_match(1.999997, 2.0)
    assert outputs_match("0.3333333", "0.33333333")


def test_big_integers_and_long_numbers_never_crash():
    import math as pymath

    big = pymath.factorial(200)  # ~7.9e374: beyond float range
    # math.isclose raised OverflowError on any wrong answer to a big-integer test.
    assert not values_match(big + 1, big)
    assert not values_match(10**400, 1.5)
    assert not values_match(10**400, 1e300, encoding="python")
    assert not values_match(float("inf"), 10**400)
    assert values_match(big, big)  # control
    digits = "1" * 5000  # past int()'s 4300-digit limit
    assert outputs_match(digits, digits) and not outputs_match(digits + "2", digits + "3")
    assert not outputs_match(digits, "1.5")


def test_non_finite_and_python_only_spellings_are_not_numbers():
    ten_400 = "1" + "0" * 400
    # float() reads all of these; no judge does.
    assert not outputs_match("inf", ten_400)  # inf == inf after float() of both
    assert not outputs_match("1e999", "1e400")
    assert not outputs_match("infinity", ten_400)
    assert not outputs_match("1_000", "1000")
    assert not outputs_match("\u0661\u0660\u0660\u0660", "1000")  # Arabic-Indic digits
    assert not outputs_match("\uff11\uff10\uff10\uff10", "1000")  # fullwidth digits
    assert not outputs_match("nan", "0.5") and not values_match(float("nan"), 0.5)
    assert not values_match(float("inf"), 1e308)
    # Controls: the plain spellings, and a token equal as text.
    assert outputs_match(ten_400, ten_400) and outputs_match("1000", "1e3")
    assert outputs_match("inf", "inf")


def test_a_value_equals_a_one_element_list_only_where_the_datasets_grader_says_so():
    program = respond("def f(x):\n    return x\n")
    # LiveCodeBench compares exactly (prediction == gt_out).
    lcb = [{"input": "5", "output": "[5]", "testtype": "functional", "metadata": {}}]
    assert parse_tests({"tests": lcb, "fn_name": "f"})[0].match == "equal"
    assert code_reward.score_code(program, {"tests": lcb, "fn_name": "f"}, CONFIG) == -1.0
    ours = [{"input": "[5]", "output": "[5]", "fn_name": "f"}]
    assert code_reward.score_code(program, ours, CONFIG) == -1.0
    # TACO / APPS (and PrimeIntellect, converted to them) also accept outputs[0].
    taco = {"inputs": [[5]], "outputs": [[5]], "fn_name": "f"}
    assert code_reward.score_code(program, taco, CONFIG) == 1.0
    prime = [{"type": "function_call", "fn_name": "f", "input": [5], "output": [5]}]
    assert code_reward.score_code(program, prime, CONFIG) == 1.0
    # ... but only of a one-element list: the first element of a longer one is no answer.
    assert not values_match(5, [5, 6], match="equal_or_only_element")
    # The canonical form keeps the rule.
    again = code_reward.parse_problem(code_reward.parse_problem(taco).to_dict())
    assert again.tests[0].match == "equal_or_only_element"


@pytest.mark.timeout(60)
def test_mbpp_is_keeps_is_and_a_bare_assert_takes_any_truthy_value():
    from megatron_rl.rewards.sandbox import Unrepresentable

    one = respond("def f(x):\n    return 1\n")
    true = respond("def f(x):\n    return True\n")
    assert code_reward.score_code(one, ["assert f(2) is True"], CONFIG) == -1.0
    assert code_reward.score_code(true, ["assert f(2) is True"], CONFIG) == 1.0
    assert code_reward.score_code(one, ["assert f(2) == True"], CONFIG) == 1.0  # 1 == True
    listing = respond("def f(x):\n    return [x]\n")
    empty = respond("def f(x):\n    return []\n")
    assert code_reward.score_code(listing, ["assert f(2)"], CONFIG) == 1.0
    assert code_reward.score_code(empty, ["assert f(2)"], CONFIG) == -1.0
    assert code_reward.score_code(empty, ["assert not f(2)"], CONFIG) == 1.0
    # A value with no literal has no truth of ours (its __bool__ would be the program's).
    assert not values_match(Unrepresentable("<P>"), True, encoding="python", match="truthy")
    with pytest.raises(ValueError, match="'is' compares with None, True or False"):
        parse_tests(["assert f(2) is 5"])


@pytest.mark.timeout(60)
def test_the_block_that_defines_the_entry_point_is_graded():
    solution = "def add(a, b):\n    return a + b\n"
    usage = "print(add(2, 3))  # example usage\n"
    response = (
        f"<think>plan</think>Solution:\n```python\n{solution}```\nExample usage:\n"
        f"```python\n{usage}```\n"
    )
    tests = ["assert add(1, 2) == 3"]
    assert code_reward.score_code(response, tests, CONFIG) == 1.0
    wrong = response.replace("a + b", "a - b")
    assert code_reward.score_code(wrong, tests, CONFIG) == -1.0
    # Stdin problems: the block that reads the input, not a usage block after it.
    stdin = (
        f"<think>plan</think>```python\n{ADD_PROGRAM}```\nRun it:\n"
        "```python\n# for the sample: 3 4 -> 7\nprint(7)\n```\n"
    )
    assert code_reward.score_code(stdin, ADD_TESTS, CONFIG) == 1.0
    # Two solutions: the last one that defines the entry point is graded, and only it.
    hedge = response.replace(usage, "def add(a, b):\n    return a * b\n")
    assert code_reward.score_code(hedge, tests, CONFIG) == -1.0


def test_second_reading_zero_padding_sets_and_stdin_readers():
    # "11" was paid for "0011" (Decimal-equal): zero-padded digits are text.
    assert not outputs_match("11", "0011") and not outputs_match("7", "007")
    assert not outputs_match("-5", "-05") and not outputs_match("5.5", "05.50")
    assert outputs_match("5.5", "5.50") and outputs_match("0.5", "0.50")  # controls
    assert outputs_match("0011", "0011") and outputs_match("007", "7")  # controls
    # A set, written as a list sorted by repr ([10, 9]), matched an expected [10, 9].
    assert not values_match({9, 10}, [10, 9]) and not values_match(frozenset({1}), [1])
    assert values_match([10, 9], [10, 9]) and values_match((10, 9), [10, 9])
    # A solution reading with ``from sys import stdin`` (or os.read(0)) was not seen as one:
    # the usage block after it was graded instead.
    config = RewardConfig(kind="code")
    problem = code_reward.parse_problem([{"input": "5 3\n", "output": "8"}])
    for reader in ("from sys import stdin\nx = stdin.read()\n", "import os\nx = os.read(0, 99)\n"):
        response = respond(reader + "print(8)\n") + "\n```python\nprint(7)\n```\n"
        assert code_reward.select_program(response, problem, config) == reader + "print(8)\n"


def test_an_integer_in_mbpp_isclose_is_a_float_reference():
    # math.isclose(f(7), 7) holds for 7.000000000000001; read as an int the reference was
    # exact and that right answer failed.
    (case,) = parse_tests(["assert math.isclose(f(7), 7)"])
    assert case.expected() == 7.0 and isinstance(case.expected(), float)
    assert values_match(7.000000000000001, case.expected(), encoding="python")
    assert not values_match(6.9, case.expected(), encoding="python")  # control
    (big,) = parse_tests([f"assert math.isclose(f(1), {10**400})"])  # beyond float: exact
    assert big.expected() == 10**400


def test_an_mbpp_isclose_tolerance_is_its_own_lines():
    # The loosest isclose line's tolerance was the problem's, so '== 0.5' paid 1.4 beside an
    # isclose line with abs_tol=1.
    lines = ["assert f(1) == 0.5", "assert math.isclose(f(2), 100.0, abs_tol=1)"]
    problem = code_reward.parse_problem(lines)
    exact, close = problem.tests
    assert exact.tolerance is None and close.tolerance == {
        "float_rel_tol": 1e-9,
        "float_abs_tol": 1.0,
    }
    assert not values_match(1.4, 0.5, exact.options(problem.compare), "python")
    assert values_match(100.3, 100.0, close.options(problem.compare), "python")  # control
    # The canonical form keeps each line's tolerance.
    again = code_reward.parse_problem(json.loads(json.dumps(problem.to_dict())))
    assert again == problem
    program = respond("def f(x):\n    return 1.4 if x == 1 else 100.0\n")
    assert code_reward.score_code(program, problem.to_dict(), CONFIG) == -1.0
    right = respond("def f(x):\n    return 0.5 if x == 1 else 100.3\n")
    assert code_reward.score_code(right, problem.to_dict(), CONFIG) == 1.0
