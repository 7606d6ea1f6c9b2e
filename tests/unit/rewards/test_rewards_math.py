"""Math reward: equivalence, answer extraction, and hostile model outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards import math as math_reward
from megatron_rl.rewards.extraction import (
    answer_section,
    extract_math_answer,
    final_boxed,
    last_boxed,
    nesting_depth,
    unevaluated_operator,
    unsafe_reason,
)
from megatron_rl.rewards.forms import (
    base_numeral,
    chosen_option,
    interval_of,
    normalise_string,
    option_hedge,
    option_text,
    ordering,
    repeating_decimal,
    scientific_notation,
    time_of_day,
    visible_answer,
)
from megatron_rl.rewards.numeric import numbers_equal
from megatron_rl.rewards.units import conversion, scaled, split_unit, unit_key, unit_value
from megatron_rl.rewards.workers import WorkerPool

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(num_workers=2, timeout_s=TIMEOUT_S)) as reward_pool:
        yield reward_pool


def respond(answer: str) -> str:
    return f"<think>some reasoning</think>The final answer is $\\boxed{{{answer}}}$."


# (model answer, reference): equivalent pairs, each a different kind of equivalence.
EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),  # decimal vs fraction
    ("1/2", "\\frac12"),  # slash vs \frac
    ("\\dfrac{3}{4}", "0.75"),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
    ("30^\\circ", "30"),  # degrees
    ("30^{\\circ}", "30"),
    ("5\\text{ cm}", "5"),  # units
    ("10\\%", "0.1"),  # percent
    ("(1,2]", "(1, 2]"),  # interval, spacing
    ("(-\\infty, 3)", "(-\\infty,3)"),
    ("\\{1,2\\}", "\\{2,1\\}"),  # sets: order does not matter
    ("x^2+2x+1", "(x+1)^2"),  # symbolic
    ("x=3", "3"),  # "x = answer"
    ("1,000", "1000"),  # thousands separator
    ("  42 ", "42"),  # spacing
    ("\\boxed{7}", "7"),  # nested \boxed
    ("\\frac{1}{\\frac{1}{2}}", "2"),  # nested braces
    ("\\frac{1}{3}", "0.333"),  # an exact answer rounds to a 3-digit decimal reference
]

NOT_EQUIVALENT = [
    ("3", "4"),
    ("\\frac{1}{3}", "0.334"),  # rounds to 0.333
    ("\\frac{1}{3}", "0.33"),  # too few digits to round to: the decimal tolerance
    ("[1,2)", "(1,2]"),  # interval ends differ
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("x^2+1", "(x+1)^2"),
    ("-5", "5"),
    ("\\sqrt{3}", "\\sqrt{2}"),
]


def test_equivalent_answers_score_plus_one_and_others_minus_one(pool):
    pairs = EQUIVALENT + NOT_EQUIVALENT
    rewards = pool.score_batch([respond(a) for a, _ in pairs], [ref for _, ref in pairs])
    expected = [1.0] * len(EQUIVALENT) + [-1.0] * len(NOT_EQUIVALENT)
    assert dict(zip(pairs, rewards)) == dict(zip(pairs, expected))


def test_thinking_is_stripped_and_must_be_closed(pool):
    responses = [
        "<think>maybe \\boxed{4}</think> so \\boxed{5}",  # only the part after </think>
        "<think>the answer is \\boxed{5} but I keep thinking",  # never closes: incorrect
        "<think>a</think><think>b \\boxed{9}</think> \\boxed{5}",  # last </think> counts
        "<think>x</think> no box, but the answer is 5",  # fallback pattern
        "<think>x</think> nothing at all",
    ]
    assert pool.score_batch(responses, ["5"] * 5) == [1.0, -1.0, 1.0, 1.0, -1.0]


def test_without_required_thinking_the_whole_response_is_the_answer():
    config = RewardConfig(require_think_end=False)
    assert extract_math_answer("so \\boxed{12}", config) == "12"
    assert extract_math_answer("so \\boxed{12}", RewardConfig()) is None


def test_configured_rewards_and_pattern():
    config = RewardConfig(correct_reward=1.0, incorrect_reward=0.0, answer_pattern=r"ANS=(\d+)")
    with RewardPool(config) as custom:
        rewards = custom.score_batch(["</think> ANS=12", "</think> ANS=13"], ["12", "12"])
        assert custom._math is None  # plain integers are decided without a worker
    assert rewards == [1.0, 0.0]


def test_stated_final_answers_are_read_without_a_box():
    # Each was misread by the old "answer (is|:)" regex ("The final answer is", ": 42", "**").
    config = RewardConfig()
    stated = {
        "Final Answer: The final answer is $\\frac{14}{3}$. I hope it is correct.": "\\frac{14}{3}",
        "The answer is: 42": "42",
        "**Final Answer:** $\\frac12$": "\\frac12",
        "Final Answer: The largest $n$ is 34.": "34",
        "The final answer is 12,000,023. I hope it is correct.": "12,000,023",
        "Answer \\[ 9 \\]": "9",
        'The final answer is "$12 $ and $13 $". I hope it is correct.': "12,13",
        "So the answer is $ \\frac{1}{2} \\$ = \\frac{10}{9} $": "\\frac{1}{2} \\$ = \\frac{10}{9}",
    }
    for text, answer in stated.items():
        assert extract_math_answer("<think>x</think>" + text, config) == answer, text
    # An inline span does not cross lines (as in Math-Verify); no answer stated at all.
    assert extract_math_answer("</think>Answer $ \n 9 \n $", config) is None
    assert extract_math_answer("</think>I am not sure about the answer.", config) is None
    # A "final answer" after the last box wins (the rightmost, as in Math-Verify).
    late = "</think>so \\boxed{255} in interest. Final Answer: The final answer is $10,455$."
    assert extract_math_answer(late, config) == "10,455"
    assert extract_math_answer(late, RewardConfig(stated_answer=False)) == "255"


def _extract(text: str, **overrides) -> str | None:
    return extract_math_answer("<think>x</think>" + text, RewardConfig(**overrides))


def test_prose_after_the_box_does_not_override_it():
    # A "final answer" sentence that states no math is no answer (issue 28, Math 1).
    boxed = {
        "the area is $\\boxed{12\\sqrt{3}}$ square units. The final answer is given in simplest "
        "radical form.": "12\\sqrt{3}",
        "Therefore $x = \\boxed{-4}$. This final answer is consistent with the check above.": "-4",
        "The probability is \\boxed{\\frac{5}{36}}. I double-checked, and the final answer is "
        "reduced to lowest terms.": "\\frac{5}{36}",
        "So \\boxed{9}. The final answer is above.": "9",
    }
    # Without a box, a clause is skipped for an earlier anchor that states math, and a
    # clause after a comma is not part of the answer.
    stated = {
        "The answer is $42$. I believe this answer is correct and complete.": "42",
        "The answer is 3/8, and the final answer is exact.": "3/8",
        "The answer is 250 meters. Note that the answer is rounded to the nearest meter.": "250 meters",
        "The answer is yes.": "yes",  # a single word, when nothing states math
    }
    for text, answer in {**boxed, **stated}.items():
        assert _extract(text) == answer, text
    # A later "final answer" that states math still wins over the box (Math-Verify's rule).
    assert _extract("\\boxed{5}. Wait, the final answer is $6$.") == "6"
    assert _extract("The answer is correct to the nearest tenth.") is None


def test_an_empty_box_is_an_instruction_not_part_of_the_answer():
    # Issue 28, Math 2: "\boxed{}: $\boxed{144}$" was read as the set ",144".
    cases = {
        "As asked, I put the result in \\boxed{}: $\\boxed{27}$.": "27",
        "The final answer (format: \\boxed{ }) is \\boxed{x^2-1}": "x^2-1",
        "\\boxed{}\\boxed{0.5}": "0.5",
        "\\fbox{} \\boxed{\\frac{2}{3}}": "\\frac{2}{3}",
        "Remember to write \\boxed{} around it. The answer is 8.": "8",
    }
    for text, answer in cases.items():
        assert _extract(text) == answer, text
    assert final_boxed("$\\boxed{1}$ and $\\boxed{}$ and $\\boxed{-2}$") == "1,-2"


def test_markdown_emphasis_around_a_stated_answer_is_taken_off():
    # Issue 28, Math 3: "**33**", "9**" and "*x* = 2" reached the verifier with the marks.
    cases = {
        "**Answer:** **-7**": "-7",
        "The final answer is ***12***.": "12",
        "**Final Answer: 0.125**": "0.125",
        "Final Answer: *n* = 15": "15",
        "The answer is __0.25__": "0.25",
        "The answer is `17`.": "17",
        "Final Answer: the total is **64**.": "64",
        "The answer is *$\\sqrt{5}$*": "\\sqrt{5}",
    }
    for text, answer in cases.items():
        assert _extract(text) == answer, text
    # Stars that are not emphasis stay: a product, and equations with more than one "=".
    assert _extract("The answer is 2*3*4.") == "2*3*4"
    assert _extract("The answer is x = 1, y = 2") == "x = 1, y = 2"


def test_answer_tags_hold_the_answer():
    # Issue 28, Math 4: R1-Zero's "<answer>28</answer>" was read as ">".
    cases = {
        "<answer>28</answer>": "28",
        " <answer>\n$\\frac{7}{2}$\n</answer>": "\\frac{7}{2}",
        "<answer>The answer is 5</answer>": "5",
        "<answer>\\boxed{5}</answer>": "5",
        "<answer>x = -3</answer>": "-3",
        "<answer>The number of ways is 120.</answer>": "120",
        "<answer>3</answer> wait, no: <answer>4</answer>": "4",  # the last tag
        "I think \\boxed{3}. <answer>4</answer>": "4",  # the tag holds the answer
        "<answer>11": "11",  # cut off before the closing tag
    }
    for text, answer in cases.items():
        assert _extract(text) == answer, text
    # Without the tag the response is read as before; another tag name; no tag at all:
    # the word "answer" in a tag is no anchor of a stated answer.
    assert _extract("So \\boxed{12}.") == "12"
    assert _extract("<final>12</final>", answer_tag="final") == "12"
    assert _extract("<answer>28</answer>", answer_tag="") is None
    for bad in ("<answer>", "an swer", 7):
        with pytest.raises(ValueError, match="answer_tag"):
            RewardConfig(answer_tag=bad).validate()


def test_answer_tag_responses_score_plus_one(pool):
    responses = [
        "<think>7 * 4</think> <answer>28</answer>",
        "<think>7 * 4</think> <answer>The answer is $\\frac{56}{2}$</answer>",
        "<think>7 * 4</think> <answer>27</answer>",
    ]
    assert pool.score_batch(responses, ["28"] * 3) == [1.0, 1.0, -1.0]


def test_bold_and_parenthesised_choices_are_unwrapped():
    # Issue 28, Math 5: "\boxed{\textbf{(073)}}" did not match "073".
    cases = {
        "\\boxed{\\textbf{(073)}}": "073",
        "\\boxed{\\mathbf{(C)}}": "C",
        "\\boxed{(204)}": "204",
        "\\boxed{\\textbf{E}}": "E",
        "\\boxed{\\textbf{(A) }}": "A",
        "The answer is $\\textbf{(D)}$.": "D",
        # Tuples, intervals and products stay as they are.
        "\\boxed{(1,2)}": "(1,2)",
        "\\boxed{(0;5)}": "(0;5)",
        "\\boxed{(x+1)(x-1)}": "(x+1)(x-1)",
        "\\boxed{(-\\infty, 3)}": "(-\\infty, 3)",
    }
    for text, answer in cases.items():
        assert _extract(text) == answer, text
    assert math_reward.reference_answer("$\\boxed{\\textbf{(B)}}$") == "B"


def test_bold_choices_score_against_plain_references(pool):
    responses = [respond("\\textbf{(073)}"), respond("\\mathbf{(072)}"), respond("\\textbf{(1,2)}")]
    assert pool.score_batch(responses, ["073", "073", "(1,2)"]) == [1.0, -1.0, 1.0]


def test_extraction_stays_linear_on_hostile_text():
    # Many boxes took 12-15 s (quadratic: each box searched the rest of the text for the
    # absent "\\fbox"); the other texts aim at the tag, markdown and unwrapping reads.
    config = RewardConfig()
    hostile = [
        "</think>" + "\\boxed{1}" * 29_000,
        "</think>" + "\\boxed{}" * 30_000,
        "</think>" + "<answer>" * 30_000,
        "</think>" + "<answer>The answer is " * 5_000 + "</answer>" * 5_000,
        "</think>The answer is " + "*" * 200_000,
        "</think>The answer is " + "*a" * 100_000,
        "</think>The answer is " + ", and the" * 20_000,
        "</think>\\boxed{" + "\\textbf{(" * 20_000 + "1" + ")}" * 20_000 + "}",
        "</think>\\boxed{" + "(" * 100_000 + "1" + ")" * 100_000 + "}",
        "</think>" + "final answer is x = " * 10_000,
        # The readings of issue 37: a closing bold value, bold after "answer".
        "</think>The value is " + "**1" * 80_000 + "**.",
        "</think>The answer, " + "**" * 100_000,
        "</think>" + "is **" * 40_000 + "4**",
        # Issue 45's readings: a retraction after the box, then many statements.
        "</think>\\boxed{5} that is wrong " + "is $1$ = : " * 20_000,
        "</think>The answer is 5. " + "that is wrong " * 18_000,
    ]
    for text in hostile:
        assert len(text) <= config.max_response_chars
        started = time.monotonic()
        extract_math_answer(text, config)
        assert time.monotonic() - started < 3.0, text[:40]


def test_minerva_response_scores_plus_one(pool):
    minerva = (
        "<think>work</think>Final Answer: The final answer is $\\frac{2}{4}$. I hope it is correct."
    )
    assert pool.score_batch([minerva, minerva], ["0.5", "\\frac13"]) == [1.0, -1.0]


def test_several_boxes_form_one_set_in_responses_and_references(pool):
    assert final_boxed("so $\\boxed{1}$ and $\\boxed{-2}$.") == "1,-2"
    assert final_boxed("\\boxed{(1, 2)}, \\boxed{(2, 1)}") == "(1, 2),(2, 1)"
    # A repeated answer counts once; a box far from the last one is not part of it.
    repeated = "\\boxed{004} is the correct answer.\n\n**Final Answer**\n\\boxed{004}"
    assert final_boxed(repeated) == "004"
    assert final_boxed("first \\boxed{3}." + " reasoning" * 10 + " so \\boxed{5}") == "5"
    assert math_reward.reference_answer("\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).") == "1,-2"
    reference = "The roots are $\\boxed{1}$ and $\\boxed{-2}$."
    responses = [
        respond("-2, 1"),  # the set, in another order
        "<think>x</think>The integers are \\boxed{-2} and \\boxed{1}.",  # boxes too
        respond("-2"),  # one of the two: not the answer
        respond("1"),
    ]
    assert pool.score_batch(responses, [reference] * 4) == [1.0, 1.0, -1.0, -1.0]
    # Boxing several candidates does not earn the reward of the one that is right.
    hedge = "<think>x</think>It is \\boxed{1}, \\boxed{2} or \\boxed{3}."
    assert pool.score_batch([hedge], ["2"]) == [-1.0]


def _spin_once_then_parse(real):
    calls = []

    def parse_target(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            # CPU-bound, as a sympy simplification that takes too long. Bounded, so that a
            # CPU alarm that never fires fails the test (a parse, not TIMEOUT) within a
            # minute instead of hanging it (CI once ran this into pytest-timeout's 600 s).
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                pass
        return real(*args, **kwargs)

    return parse_target


@pytest.mark.timeout(180)  # ~1 s; the spin above gives up after 60 s
def test_verification_out_of_time_is_timeout_and_not_cached(monkeypatch):
    # Math-Verify's own limit reported this as False, and the failed reference parse was
    # cached: every later response to the prompt scored -1 in that worker.
    import math_verify.parser

    real = math_verify.parser.extract_target_from_pred
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", _spin_once_then_parse(real))
    reference = "\\frac{7}{13}"  # parsed by no other test in this process
    started = time.process_time()
    assert math_reward.verify("7/13", reference, 2.0) == math_reward.TIMEOUT
    assert time.process_time() - started < 2.0  # the CPU budget, not an endless loop
    assert math_reward.verify("7/13", reference, 2.0) == math_reward.CORRECT
    assert math_reward.verify("7/12", reference, 2.0) == math_reward.WRONG


def test_timeouts_are_a_status_of_their_own():
    with RewardPool(RewardConfig(num_workers=1, timeout_s=1.0)) as one:
        rewards = one.score_batch(
            [respond("10^{100000}!"), respond("\\frac{1}{2}"), respond("3"), "</think>none"],
            ["5", "0.5", "4", "4"],
        )
        assert rewards == [-1.0, 1.0, -1.0, -1.0]
        assert one.last_statuses == ["timeout", "correct", "in_process", "in_process"]
        assert one.last_counts["timeout"] == 1


def test_extraction_helpers():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert last_boxed("\\boxed{\\boxed{a}+b}") == "\\boxed{a}+b"
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed{5} and an unclosed \\boxed{6") == "5"
    assert last_boxed("\\fbox{8}") == "8"
    assert last_boxed("no box") is None
    assert answer_section("<think>a</think>b</think>c", "</think>", True) == "c"
    assert nesting_depth("{(a)[b]}") == 2


def test_unsafe_reasons():
    config = RewardConfig()
    assert unsafe_reason("9^{9^{9^9}}", config) is not None  # power in an exponent
    assert unsafe_reason("9^9^9", config) is not None  # power tower
    assert unsafe_reason("2^{1000001}", config) is not None  # exponent over the limit
    assert unsafe_reason("123456!", config) is not None  # factorial over the limit
    assert unsafe_reason("1" * 500, config) is not None  # literal with too many digits
    assert unsafe_reason("{" * 40 + "}" * 40, config) is not None
    assert unsafe_reason("x" * 2000, config) is not None
    for fine in ("2^{10}", "x^{n+1}", "\\frac{1}{2}", "10!", "(1,2]", "e^{i\\pi}"):
        assert unsafe_reason(fine, config) is None, fine


def _payloads(canary: str) -> list[str]:
    return [
        f"__import__('os').system('touch {canary}')",
        f"__import__('pathlib').Path('{canary}').touch()",
        f"(lambda: open('{canary}', 'w').write('x'))()",
        f"exec(\"open('{canary}', 'w')\")",
        f'eval(\'__import__("os").system("touch {canary}")\')',
        f"getattr(__builtins__, '__import__')('os').system('touch {canary}')",
    ]


def test_payloads_would_create_the_canary_if_executed(tmp_path):
    # The payloads are real: evaluated as Python they create the canary.
    for i, payload in enumerate(_payloads(str(tmp_path / "canary"))):
        canary = tmp_path / f"canary{i}"
        code = payload.replace(str(tmp_path / "canary"), str(canary))
        subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=30)
        assert canary.exists(), payload


def test_hostile_outputs_score_minus_one_fast_and_execute_nothing(pool, tmp_path):
    canary = tmp_path / "canary"
    answers = _payloads(str(canary)) + [
        "9^{9^{9^9}}",
        "10^{10^{10}}",
        "{" * 10_000 + "1" + "}" * 10_000,
        "(" * 10_000 + "1" + ")" * 10_000,
        "1" * 1_000_000,
        "\\frac{1}{2}" * 100_000,
        "10^{100000}!",  # passes the static checks, then hits the worker's time limit
    ]
    responses = [respond(a) for a in answers] + [
        "x" * 1_000_000,  # 1 MB of text, no answer
        "<think>" + "\\boxed{" * 100_000 + "</think>\\boxed{" * 50_000,  # unclosed boxes
        "</think>" + "\\left(" * 100_000,
    ]
    assert pool.score_batch([respond("0.5")], ["\\frac12"]) == [1.0]  # workers started
    started = time.monotonic()
    rewards = pool.score_batch(responses, ["1"] * len(responses))
    elapsed = time.monotonic() - started
    assert rewards == [-1.0] * len(responses)
    assert not canary.exists()
    assert pool.stats["blocked_events"] == 0  # nothing was even attempted
    # Everything is rejected up front except the last answer, which costs at most one
    # time limit (of CPU time: more on a loaded machine) plus a worker restart.
    assert elapsed < TIMEOUT_S + 15, elapsed


def test_stuck_verification_times_out_and_the_next_answer_is_verified():
    # The worker's CPU budget (or the parent's kill, for a stall in C code) ends it.
    with RewardPool(RewardConfig(num_workers=1, timeout_s=1.0)) as one:
        assert one.score_batch([respond("\\frac{1}{4}")], ["0.25"]) == [1.0]
        started = time.monotonic()
        rewards = one.score_batch([respond("10^{100000}!"), respond("\\frac{1}{2}")], ["5", "0.5"])
        assert rewards == [-1.0, 1.0]  # the next answer still gets verified
        assert time.monotonic() - started < 20
        assert one.stats["verify_timeout"] == 1


def test_score_batch_works_from_another_thread(pool):
    results = []
    thread = threading.Thread(
        target=lambda: results.append(pool.score_batch([respond("0.5")], ["\\frac12"]))
    )
    thread.start()
    thread.join(timeout=60)
    assert results == [[1.0]]


def test_public_one_shot_score():
    assert math_reward.score(respond("\\frac{2}{4}"), "0.5") == 1.0
    assert math_reward.score(respond("9^{9^{9^9}}"), "0.5") == -1.0
    assert math_reward.score("<think>\\boxed{0.5}", "0.5") == -1.0


def test_batch_validation(pool):
    with pytest.raises(ValueError, match="differ in length"):
        pool.score_batch(["a"], [])
    with pytest.raises(ValueError, match="unknown reward kinds"):
        pool.score_batch(["a"], ["1"], kinds=["poetry"])


def _spin() -> None:
    while True:
        pass


def _crash() -> None:
    os._exit(3)


def _double(x: int) -> int:
    return 2 * x


def _sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def test_worker_pool_limits_cpu_time_with_a_wall_clock_backstop():
    # Waiting (as a worker starved by load does) uses no CPU: only the backstop ends it.
    with WorkerPool(num_workers=1, timeout_s=0.5, wall_timeout_s=3.0) as workers:
        assert workers.map(_sleep, [(1.5,)])[0].value == "slept"
        started = time.monotonic()
        assert workers.map(_sleep, [(60,)])[0].status == "timeout"
        assert 3.0 <= time.monotonic() - started < 10
    with pytest.raises(ValueError, match="wall_timeout_s"):
        RewardConfig(timeout_s=5, wall_timeout_s=1).validate()


def test_worker_pool_timeout_crash_and_order():
    with WorkerPool(num_workers=2, timeout_s=1.0) as workers:
        results = workers.map(_double, [(i,) for i in range(6)])
        assert [r.value for r in results] == [0, 2, 4, 6, 8, 10]
        started = time.monotonic()
        mixed = workers.map(_spin, [()] * 2)
        assert [r.status for r in mixed] == ["timeout", "timeout"]
        assert time.monotonic() - started < 15  # 1 s of CPU each, on a loaded machine
        assert workers.map(_crash, [()])[0].status == "crashed"
        assert [r.value for r in workers.map(_double, [(5,)])] == [10]


def test_config_validation():
    with pytest.raises(ValueError, match="kind"):
        RewardConfig(kind="poetry").validate()
    with pytest.raises(ValueError, match="correct_reward"):
        RewardConfig(correct_reward=-1.0, incorrect_reward=1.0).validate()
    with pytest.raises(ValueError, match="answer_pattern"):
        RewardConfig(answer_pattern="(unclosed").validate()
    with pytest.raises(ValueError, match="timeout_s"):
        RewardConfig(timeout_s=0).validate()
    RewardConfig().validate()


SUITE = Path(__file__).resolve().parents[2] / "data" / "math_verify_suite.jsonl"


def _suite_cases(forms: tuple[str, ...] = ("boxed", "stated")) -> list[dict]:
    """Math-Verify's public test cases as responses (see tests/data/README.md)."""
    with open(SUITE) as f:
        cases = [json.loads(line) for line in f if line.strip() and not line.startswith("#")]
    return [c for c in cases if c["answer_form"] in forms]


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~40-90 s on 2 shared cores
def test_agreement_with_math_verify_suite():
    # The expected verdicts are Math-Verify's own, written in its tests.
    cases = _suite_cases()
    with RewardPool(RewardConfig(num_workers=2)) as two:
        rewards = two.score_batch([c["response"] for c in cases], [c["reference"] for c in cases])
        assert two.last_counts["timeout"] == 0
    agree = [(r > 0) == bool(c["expected"]) for c, r in zip(cases, rewards)]
    assert len(cases) >= 200
    # Issue 37: at least 96%, and no answer that Math-Verify calls wrong is rewarded.
    assert sum(agree) / len(cases) >= 0.96, [c["id"] for c, a in zip(cases, agree) if not a]
    assert [c["id"] for c, r in zip(cases, rewards) if r > 0 and not c["expected"]] == []


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~40-120 s on 2 shared cores
def test_same_rewards_with_one_and_two_workers_under_load():
    # Several responses per reference (as in a group), in an order that differs per run.
    cases = _suite_cases()[::8]
    responses = [c["response"] for c in cases] * 2
    references = [c["reference"] for c in cases] * 2
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        results = {}
        for workers in (1, 2):
            with RewardPool(RewardConfig(num_workers=workers)) as scoring:
                results[workers] = scoring.score_batch(responses, references)
                assert scoring.last_counts["timeout"] == 0, workers
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert results[1] == results[2]
    assert results[1][: len(cases)] == results[1][len(cases) :]
    assert 0 < sum(r > 0 for r in results[1]) < len(responses)  # not all one verdict


def test_a_unit_comes_off_only_alone_at_the_end_of_a_constant_answer():
    # Issue 37, 1: Math-Verify's stripping read letters inside expressions (and am / pm) as
    # units. More of these score -1 in tests/data/math_adversarial_suite.jsonl.
    split = {
        "48\\,\\mathrm{mL}": ("48", "mL"),
        "48 mL": ("48", "mL"),
        "9\\text{ km}": ("9", "km"),
        "18 \\text{ cm}^2": ("18", "cm^2"),  # a unit with its power
        "\\frac{25}{3} m": ("\\frac{25}{3}", "m"),
        "2\\pi \\text{ cm}": ("2\\pi", "cm"),
        "7.5 km/h": ("7.5", "km/h"),
        "64kg": ("64", "kg"),
        "14 square units": ("14", "square units"),
        "-3.2\\times 10^{4} \\text{ J}": ("-3.2\\times 10^{4}", "J"),
        "45 \\mathrm{~cm}^{2}": ("45", "cm^2"),  # the spacing of GaoKao's answers
        "72 \\mathrm{~km} / \\mathrm{h}": ("72", "km/h"),
        "y = 4 \\text{ m}": ("y = 4", "m"),  # the unit of the right side
        "9 \\text{ (approximately)}": ("9", "approximately"),
        "15,600 cm": ("15,600", "cm"),  # a thousands separator
        "0, 1 \\text{ units}": ("0, 1", "units"),  # the unit of each item of a list
    }
    kept = [
        "6 + 5t",  # a term in t, not tons
        "2y + 9 m",  # the unit of one term is not the answer's
        "3 + \\frac{1}{4}s",
        "4k",  # a letter against a number is a variable
        "\\frac{2}{5}g",
        "x \\text{ cm}",  # the value is not a constant
        "x, 2 \\text{ cm}",
        "6 pm",  # a time of day keeps its marker
        "8 \\text{ a.m.}",
        "11\\,\\mathrm{PM}",
        "5 \\sin",
        "3 \\text{ or } 4",
        "12 \\text{ (or 13)}",  # a hedge in a text command
        "12 plus x",
        "y = 4 + 2 \\text{ m}",
    ]
    for answer, expected in split.items():
        assert split_unit(answer) == expected, answer
    for answer in kept:
        assert split_unit(answer) is None, answer


def test_times_of_day_keep_am_and_pm():
    assert time_of_day("4:05 \\text{ p.m.}") == time_of_day("\\text{4:05 p.m.}") == 16 * 60 + 5
    assert time_of_day("9am") == time_of_day("9\\,\\mathrm{a.m.}") == 9 * 60
    assert time_of_day("12 noon") == time_of_day("12 p.m.") == 12 * 60
    assert time_of_day("12:00 a.m.") == time_of_day("midnight") == 0
    assert time_of_day("21:40") is None  # no marker: not known to be a time
    assert time_of_day("21:40", marker_required=False) == 21 * 60 + 40
    for not_a_time in ("13 pm", "9:75 am", "x pm", "9 am or 10 am", "2 \\text{ m}"):
        assert time_of_day(not_a_time, marker_required=False) is None, not_a_time


def test_units_and_times_of_day_score(pool):
    pairs = [
        # A unit alone at the end, on either side, against a constant reference.
        ("48 mL", "48", 1.0),
        ("48", "48\\,\\mathrm{mL}", 1.0),
        ("18 \\text{ cm}^2", "18", 1.0),
        ("\\frac{25m}{3}", "\\frac{25}{3} m", 1.0),  # a unit inside a fraction
        ("\\frac{25}{3}", "\\frac{25}{3} m", 1.0),
        ("8.3 m", "\\frac{25}{3} m", -1.0),
        ("72 \\mathrm{~km} / \\mathrm{h}", "72", 1.0),
        ("45", "45 \\mathrm{~cm}^{2}", 1.0),
        ("y = 4 \\text{ m}", "4", 1.0),
        # A reference that ends in a symbol is compared as it is.
        ("\\frac{c}{\\sqrt{3}}", "\\frac{1}{\\sqrt{3}}c", 1.0),
        ("\\frac{\\sqrt{3}c}{3}", "\\frac{1}{\\sqrt{3}}c", 1.0),
        ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}c", -1.0),
        ("5 \\text{ km}", "5k", -1.0),
        # Times of day: the marker is part of the answer.
        ("7:15 \\text{ a.m.}", "\\text{7:15 a.m.}", 1.0),
        ("19:15", "7:15 \\text{ p.m.}", 1.0),
        ("10pm", "10 \\text{ p.m.}", 1.0),
        ("10 \\text{ a.m.}", "10 \\text{ p.m.}", -1.0),
        ("7:15", "\\text{7:15 p.m.}", -1.0),
    ]
    rewards = pool.score_batch([respond(a) for a, _, _ in pairs], [r for _, r, _ in pairs])
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_an_option_letter_with_its_text_is_the_letter(pool):
    # Issue 37, 3: "(D) (2,0)" against the reference "D" scored -1.
    assert chosen_option("(B) (-1,4)") == "B"
    assert chosen_option("\\textbf{(E)}\\ 3\\sqrt{2}") == "E"
    assert chosen_option("C. $y=2x+1") == "C"
    for hedge in ("(A) \\text{ or } (C)", "(B), D", "(C) (D)", "A/B", "(a) 7", "(3,1)"):
        assert chosen_option(hedge) is None, hedge
    pairs = [
        ("(B) (-1,4)", "B", 1.0),
        ("(A) $3(x-2)=3x-6", "A", 1.0),
        ("\\text{(C) } 12", "(C)", 1.0),
        ("\\textbf{(E)}\\ 3\\sqrt{2}", "\\textbf{(E)}", 1.0),
        ("(B) (-1,4)", "C", -1.0),
        ("(A) \\text{ or } (C)", "C", -1.0),
    ]
    rewards = pool.score_batch([respond(a) for a, _, _ in pairs], [r for _, r, _ in pairs])
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_scientific_notation_is_a_number(pool):
    # Issue 37, 4: the reference "1e-3" was read as e - 3 (Euler's number).
    assert scientific_notation("4e-5") == "4\\times 10^{-5}"
    assert scientific_notation("\\frac{6.1E3}{2}") == "\\frac{6.1\\times 10^{3}}{2}"
    for kept in ("2e", "e-4", "3e+2", "x2e3", "2e^{3}", "7e-4y", "1e12345"):
        assert scientific_notation(kept) == kept, kept
    pairs = [
        ("0.00004", "4e-5", 1.0),
        ("4e-5", "0.00004", 1.0),
        ("6.1E3", "6100", 1.0),
        ("2.5\\times 10^{-2}", "2.5e-2", 1.0),
        ("4e-5", "e - 5", -1.0),
        ("0.00004", "4e-6", -1.0),
    ]
    rewards = pool.score_batch([respond(a) for a, _, _ in pairs], [r for _, r, _ in pairs])
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_the_string_fallback_ignores_spaces_and_single_token_braces(pool):
    # Issue 37, 5: what sympy cannot parse is compared as text, which was space- and
    # brace-sensitive: "E_{1}, E_{2}" scored -1 against "E_{1},E_{2}".
    assert normalise_string("E_{3} ,  E_{ 4 }") == "E_3,E_4"
    assert normalise_string("E_{34}") == "E_{34}"  # two digits keep their braces
    assert normalise_string("E_{3}4") == "E_34"  # E_3 times 4: not E_{34}
    assert normalise_string("\\pi  r") == "\\pi r"  # a command's name ends at the space
    pairs = [
        ("E_{3} , E_{4}", "E_{3},E_{4}", 1.0),
        ("E_3", "E_{3}", 1.0),
        ("E_{3},E_{4}", "E_{3}, E_{5}", -1.0),
        ("E_{34}", "E_{3}4", -1.0),
    ]
    rewards = pool.score_batch([respond(a) for a, _, _ in pairs], [r for _, r, _ in pairs])
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_percent_signs_score_alike_for_integers_and_decimals(pool):
    # Issue 37, 6: "25" against "25\%" scored +1 but "17.5" against "17.5\%" -1.
    pairs = [
        ("62.5", "62.5\\%", 1.0),
        ("62.5\\%", "62.5", 1.0),
        ("0.625", "62.5\\%", 1.0),
        ("64", "64\\%", 1.0),
        ("62.5\\%", "62.5\\%", 1.0),
        ("6.25", "62.5\\%", -1.0),
        ("0.625\\%", "62.5\\%", -1.0),
    ]
    rewards = pool.score_batch([respond(a) for a, _, _ in pairs], [r for _, r, _ in pairs])
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_a_value_in_bold_that_ends_the_response_is_its_answer(pool):
    # Issue 37, 8: without a box or the word "answer", a closing "is **4**" was not read.
    read = {
        "The length of $AB$ is **9**.": "9",
        "So the mean of the set is **6.25**.": "6.25",
        "The product equals ***-12***!": "-12",
        "Converting back, the sum in base 6 is **$52_6$**.": "52_6",
        "Hence the answer, **cos B = 3/5**, agrees with the figure.": "cos B = 3/5",
    }
    unread = [
        "The length of $AB$ is **8** or **9**.",  # a hedge
        "The trick is **to complete the square**.",  # bold prose
        "We get **9**, then check the other case.",  # bold that ends nothing
        "**9**",  # nothing states it
    ]
    for text, answer in read.items():
        assert _extract(text) == answer, text
    for text in unread:
        assert _extract(text) is None, text
    pairs = [
        ("The length of $AB$ is **9**.", "9", 1.0),
        ("So the mean of the set is **6.25**.", "\\frac{25}{4}", 1.0),
        ("Hence the answer, **cos B = 3/5**, agrees with the figure.", "\\frac35", 1.0),
        ("Converting back, the sum in base 6 is **$52_6$**.", "52_6", 1.0),
        ("The length of $AB$ is **8**, not **9**.", "8", -1.0),
        ("The length of $AB$ is **8** or **9**.", "9", -1.0),
    ]
    rewards = pool.score_batch(
        ["<think>x</think>" + t for t, _, _ in pairs], [r for _, r, _ in pairs]
    )
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_a_numeral_in_a_base_keeps_its_base(pool):
    # Issue 37, 8: Math-Verify dropped the subscript, so 52_7 equalled 52_6.
    assert base_numeral("52_{6}") == base_numeral("52_6") == ("52", 6)
    assert base_numeral("1f_{16}") == ("1F", 16)
    assert base_numeral("52") == ("52", None)
    assert base_numeral("\\text{52}_{(6)}") == ("52", 6)
    for not_a_numeral in ("x_6", "a_5", "E_{3}4", "52_{6}+1", "72_6", "52_6, 52_7", "5.2_6"):
        assert base_numeral(not_a_numeral) is None, not_a_numeral
    pairs = [
        ("52_6", "52_6", 1.0),
        ("52_{6}", "$52_6$", 1.0),
        ("52", "52_6", 1.0),  # the digits, in the base the question asked for
        ("52_7", "52_6", -1.0),
        ("32", "52_6", -1.0),  # its value in base 10 is not what was asked
        ("1011_2", "1011_{2}", 1.0),
        ("52_6, 52_7", "52_6", -1.0),  # a hedge over bases
    ]
    rewards = pool.score_batch([respond(a) for a, _, _ in pairs], [r for _, r, _ in pairs])
    assert dict(zip(pairs, rewards)) == {pair: pair[2] for pair in pairs}


def test_answers_are_read_as_they_render():
    # Issue 45: Math-Verify read \phantom{6} as 6, \phantom{3}4 as 7, the inner box of
    # \boxed{\boxed{6}5} as 6, 10\,000 as 10 * 000, and nothing of \color{red}{5}.
    assert visible_answer("\\phantom{6}") == ""
    assert visible_answer("\\phantom{3}4") == visible_answer("4\\hphantom{3}") == "4"
    assert visible_answer("\\boxed{6}5") == "65"
    assert visible_answer("10\\,000") == "10000"
    assert visible_answer("1\\,234\\,567.5") == "1234567.5"
    assert visible_answer("\\textcolor{red}{5}") == visible_answer("{\\color{red}5}") == "5"
    assert visible_answer("5\u200b") == visible_answer("\\cancel{6}5") == "5"
    assert visible_answer("\\colorbox{white}{5}") == "5"  # a white background shows it
    # Round five: visible formatting keeps a number in place, and braces around a number
    # that delimit nothing go (Math-Verify read {3}4 as 3 + 4 = 7).
    for shown in ("\\mathbf{8}7", "\\textcolor{red}{8}7", "\\smash{8}7", "{8}7", "{8}{7}"):
        assert visible_answer(shown) == "87", shown
    assert visible_answer("\\text{\u2212}7") == visible_answer("\\mathrm{-}7") == "-7"
    assert visible_answer("2^\\mathbf{8}7") == "2^{8}7"  # an exponent stays one
    for kept in ("\\mathbf{v}", "5\\text{ cm}", "\\frac {1} {2}", "\\sqrt[3]{8}", "x^2{3}"):
        assert visible_answer(kept) == kept, kept
    assert visible_answer("45°") == "45^{\\circ}"
    assert visible_answer("5²") == "5^{2}" and visible_answer("−½") == "-\\frac{1}{2}"
    for hidden in ("3\\,5", "12\\,34", "\\color{white}{6}", "\\textcolor{white}{6}"):
        assert visible_answer(hidden) is None, hidden
    for kept in ("\\frac{1}{2}", "x^2 + 1", "\\{1,2\\}"):
        assert visible_answer(kept) == kept


def test_repeating_decimals_are_the_fractions_they_write():
    # The fractions by hand: 0.1666... = 1/6, 0.142142... = 142/999, 6.999... = 7.
    assert repeating_decimal("0.\\overline{3}") == repeating_decimal("0.\\dot{3}") == "\\frac{1}{3}"
    assert repeating_decimal("0.(3)") == repeating_decimal("0.\\bar{3}") == "\\frac{1}{3}"
    assert repeating_decimal("0.1\\overline{6}") == "\\frac{1}{6}"
    assert repeating_decimal("0.\\dot{1}4\\dot{2}") == "\\frac{142}{999}"
    assert repeating_decimal("6.\\overline{9}") == repeating_decimal("7.0\\overline{0}") == "7"
    assert repeating_decimal("-0.\\overline{3}") == "-\\frac{1}{3}"
    assert repeating_decimal("2 \\cdot 0.\\overline{3}") == "2 \\cdot (\\frac{1}{3})"
    for kept in ("0.5(3)", "0.333\\ldots", "f(0.5)", "0.\\overline{3}4"):
        assert repeating_decimal(kept) == kept, kept


def test_multiplier_words_scale_and_units_must_agree():
    assert scaled("5 million") == "5\\times 10^{6}"
    assert scaled("3 \\text{ dozen}") == "3\\times 12"
    assert scaled("7 hundredths") == "7\\times \\frac{1}{100}"
    assert scaled("2,500 thousand dollars") == "2500\\times 1000 dollars"
    assert scaled("5 factorial") == "5!" and scaled("12 percent") == "12\\%"
    for kept in ("5 apples", "x thousand", "5 + 3 million", "5"):
        assert scaled(kept) == kept
    same = [
        ("5 cm", "5 \\text{ centimeters}", "cm"),
        ("5 s", "5\\,\\mathrm{seconds}", "s"),
        ("12 \\text{ m}^2", "12 square meters", "m^2"),
        ("60 km/h", "60 kilometers per hour", "km/h"),
        ("30^\\circ", "30 \\text{ degrees}", "deg"),
        ("5 mL", "5 ml", "ml"),
    ]
    for a, b, key in same:
        assert unit_key(a) == unit_key(b) == key, (a, b)
    for a, b in (("5 mm", "5 cm"), ("5 min", "5 s"), ("12 m^2", "12 m^3"), ("5 g", "5 kg")):
        assert unit_key(a) != unit_key(b), (a, b)
    for no_unit in ("5", "4h", "5 factorial", "5 \\text{ (wrong)}", "5 \\text{ probably}"):
        assert unit_key(no_unit) is None, no_unit


def test_abbreviated_multipliers_and_unit_conversions():
    """Issue 45 round five: abbreviations and counting words scale (``5\\text{k}`` was taken
    off as a unit and equalled 5), units convert exactly within one dimension (the factors
    are the definitions: 1 in = 2.54 cm, 1 lb = 0.45359237 kg, 1 mi = 1609.344 m)."""
    assert scaled("5\\text{k}") == scaled("5\\mathrm{ k}") == "5\\times 1000"
    assert scaled("\\$5\\text{k}") == "\\$5\\times 1000"
    assert scaled("5\\text{ lakh}") == "5\\times 10^{5}" and scaled("4 score") == "4\\times 20"
    assert scaled("5\\text{ gross}") == "5\\times 144" and scaled("5 tens") == "5\\times 10"
    assert scaled("50\\text{ pct}") == "50\\%"
    for kept in ("5k", "5 k", "5\\text{ mil}", "5\\text{ MM}", "5\\text{ scores}", "5\\text{K}"):
        assert scaled(kept) == kept, kept
    for not_unit in ("5\\text{ mil}", "5 MM", "5 bn", "5\\text{ grand}", "5 \\text{k}"):
        assert split_unit(not_unit) is None, not_unit
    assert unit_key("5\\text{ min}") == unit_key("5 minutes") == "min"
    assert unit_key("5\\text{ sec}") == "s" and unit_key("5 m") == "m"
    assert unit_key("\\$5") == "dollar" and unit_value("\\$ 5") == "5"
    assert unit_key("5\\text{ m/s^2}") == "m/s^2"
    assert unit_value("x = 300\\text{ s}") == "300"
    assert conversion("min", "s") == 60 and conversion("cm", "m") == Fraction(1, 100)
    assert conversion("dollar", "cent") == 100 and conversion("in", "cm") == Fraction(254, 100)
    assert conversion("lb", "kg") == Fraction(45359237, 10**8)
    assert conversion("mi/h", "km/h") == Fraction(1609344, 10**6)
    assert conversion("m/s", "km/h") == Fraction(36, 10)
    assert conversion("m^2", "cm^2") == 10**4 and conversion("l", "cm^3") == 1000
    for apart in (("min", "m"), ("m", "m^2"), ("month", "day"), ("t", "kg"), ("deg", "rad")):
        assert conversion(*apart) is None, apart


def test_compound_units_are_products_and_stacked_multiplier_words_multiply():
    """Issue 45 round six: wrapped units joined by ``\\cdot`` were read as a quotient
    (``5\\text{ m}\\cdot\\text{s}`` equalled ``5\\text{ m/s}``), a negative power was no
    unit, ``m/min`` was refused (``min`` read as the function), and only the first of
    stacked multiplier words scaled. The factors are the definitions: 1 m/s = 60 m/min =
    3.6 km/h, 1 kg = 1000 g."""
    assert unit_key("5\\text{ m}\\cdot\\text{s}") == "m s"
    assert unit_key("5\\,\\text{m}\\cdot\\text{s}^{-1}") == unit_key("5\\text{ m/s}") == "m/s"
    assert unit_key("5 m s^{-1}") == unit_key("5 meters per second") == "m/s"
    assert unit_key("5 \\text{N}\\cdot\\text{m}") == unit_key("5\\text{ m}\\cdot\\text{N}") == "N m"
    assert unit_key("300\\text{ m/min}") == "m/min" and unit_key("5 s^{-1}") == "1/s"
    assert unit_key("5 \\text{kg}\\,\\text{m}/\\text{s}^2") == "kg m/s^2"
    assert conversion("m/s", "m/min") == 60 and conversion("m/s", "km/h") == Fraction(36, 10)
    assert conversion("kg m/s^2", "g m/s^2") == 1000
    for apart in (("m s", "m/s"), ("1/s", "s"), ("m/s^2", "m/s")):
        assert conversion(*apart) is None, apart
    assert scaled("5\\text{ hundred thousand}") == scaled("5 hundred thousand")
    assert scaled("5 hundred thousand") == "5\\times 100\\times 1000"
    assert scaled("3\\text{ thousand million}") == "3\\times 1000\\times 10^{6}"
    assert scaled("2\\text{ thousand dollars}") == "2\\times 1000 \\text{ dollars}"
    # "seven hundred thousandths" is 0.7 or 0.00007: a fraction word stacks with nothing.
    assert scaled("7 hundred thousandths") == "7\\times 100 thousandths"


def test_operators_left_undone_options_orderings_and_intervals():
    for restated in (
        "\\int_0^1 x^2dx",
        "\\sum_{k=1}^{10}k^2",
        "\\lim_{x\\to 0}\\frac{\\sin x}{x}",
        "\\frac{d}{dx}x^3",
        "\\frac{\\mathrm{d}}{\\mathrm{d}x}x^3",
        "\\gcd(12,18)",
        "\\operatorname{lcm}(4,6)",
        "\\max(3,5)",
    ):
        assert unevaluated_operator(restated) is not None, restated
    for final in ("\\frac{d}{2}", "\\sin x + \\cos x", "dx + 1", "\\binom{5}{2}", "5!"):
        assert unevaluated_operator(final) is None, final
    for hedge in ("C) 12; D) 14", "C: 12, D: 14", "\\text{C. 12; D. 14}", "(B) or (D)"):
        assert option_hedge(hedge), hedge
    for choice in ("C) 12", "C: 12 cm", "\\text{C. } 12", "(C) 12 \\text{ cm}"):
        assert not option_hedge(choice), choice
    assert option_text("C) 12") == option_text("\\text{(C) } 12") == "12"
    assert option_text("(B) $-1$") == "-1"
    for no_option in ("C) 12; D) 14", "(3,1)", "A", "x = 5"):
        assert option_text(no_option) is None, no_option
    assert ordering("b > a > c", "b, a, c") is True
    assert ordering("c < a < b", "b, a, c") is False  # listed as written
    assert ordering("1 < 2 < 3", "1, 2, 3") is None  # no named things
    assert ordering("x > 2", "[2, 3]") is None
    assert interval_of("1\\le x\\le 2", "[1,2]") == "[1,2]"
    assert interval_of("1 < x \\leq 2", "(1, 2]") == "(1,2]"
    assert interval_of("1\\le x\\le 2", "3") == "1\\le x\\le 2"  # no interval asked for
    assert interval_of("x \\geq 3", "[3, \\infty)") == "[3,\\infty)"
    assert interval_of("x < 2", "(-\\infty, 2)") == "(-\\infty,2)"
    assert interval_of("x \\geq 3", "[3, 5]") == "x \\geq 3"  # a ray answers a ray only


def test_numbers_compare_exactly_unless_the_reference_is_a_decimal():
    # Issue 45: Math-Verify's float_rounding=6 made 0.0 equal every reference below 5e-7.
    from sympy import Float, Integer, Rational, pi, sqrt

    assert numbers_equal(Rational(3, 10**7), Float(0.0)) is False
    assert numbers_equal(Integer(10**17 + 7), Float(1e17)) is False
    assert numbers_equal(Integer(10**17), Float(1e17)) is True
    assert numbers_equal(Rational(1, 3), Float("0.3333333")) is False
    assert numbers_equal(Rational(1, 8), Float("0.125")) is True
    assert numbers_equal(Float("0.0001234"), Float("0.0001232")) is False
    assert numbers_equal(Float("3.14159265"), Float("3.1415927")) is True  # 1.6e-8 relative
    assert numbers_equal(sqrt(2), Float("1.4142136")) is False
    assert numbers_equal(5 * sqrt(42) / 27, 10 * sqrt(Float(10.5)) / 27) is True
    assert numbers_equal(pi / 6, pi / 6) is True
    assert numbers_equal(Integer(1), pi) is False


def test_an_infinity_equals_only_the_same_infinity(monkeypatch):
    """Issue 45: the answer ``\\infty^{\\infty}`` scored +1 against the reference 7 in some
    runs of a probe batch (2 of 6 here) and -1 in others. Math-Verify's symbolic rule
    simplifies the difference of the two, and sympy 1.14's ``simplify(7 - oo**oo)`` (the
    power unevaluated, as parsed) gave 0 in about one process in five, -oo in the others.
    A difference with an infinity in it is no longer simplified: sympy's 0 is forced here,
    and the verdicts are the extended reals' (hand-checked)."""
    from math_verify import grader
    from sympy import Integer, Pow, S, nan, oo, zoo

    monkeypatch.setattr(grader, "simplify", lambda expr, *args, **kwargs: Integer(0))
    for prediction, reference, verdict in [
        ("\\infty^{\\infty}", "7", math_reward.WRONG),
        ("\\infty", "7", math_reward.WRONG),
        ("-\\infty", "\\infty", math_reward.WRONG),
        ("x+\\infty", "7", math_reward.WRONG),
        ("\\infty^{\\infty}", "\\infty", math_reward.CORRECT),
        ("\\infty", "\\infty", math_reward.CORRECT),
        ("-\\infty", "-\\infty", math_reward.CORRECT),
    ]:
        assert math_reward.verify(prediction, reference, 0) == verdict, (prediction, reference)
    power = Pow(oo, oo, evaluate=False)
    assert numbers_equal(Integer(7), power) is False
    assert numbers_equal(S.Infinity, power) is True
    assert numbers_equal(S.Infinity, -oo) is False and numbers_equal(zoo, oo) is False
    assert numbers_equal(nan, nan) is False and numbers_equal(Integer(7), nan) is False
