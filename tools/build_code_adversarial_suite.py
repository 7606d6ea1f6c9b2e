"""Write tests/data/code_adversarial_suite.jsonl: programs a policy would try on the code reward.

Issue 45's classes, each with several probes and a matched control: crashes (big integers,
malformed or forged reports, results nested past the recursion limit), false positives
(integer tolerance, non-finite values, Python-only number spellings, a value for a
one-element list where the dataset's grader does not allow it, MBPP's ``is``, attacks on the
harness) and misses (a worker thread with a larger stack, an example-usage block after the
solution, MBPP's bare ``assert f(x)`` with a truthy value). ``expect`` is the reward a
correct grader gives: -1 for every probe of a false-positive or crash class, +1 for every
miss, and the controls the other way round where they are the right answer. Scored by
tests/unit/rewards/test_rewards_code_adversarial.py. Usage:
``python tools/build_code_adversarial_suite.py [OUT]``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "code_adversarial_suite.jsonl"


def respond(program: str, usage: str = "") -> str:
    text = f"<think>\nI worked it out.\n</think>\n\n```python\n{program}```\n"
    if usage:
        text += f"\nExample usage:\n\n```python\n{usage}```\n"
    return text


def stdin_tests(output: str, given: str = "") -> list[dict]:
    return [{"input": given, "output": output}]


def lcb(fn: str, args: list, output: object) -> dict:
    line = "\n".join(json.dumps(a) for a in args)
    test = {"input": line, "output": json.dumps(output), "testtype": "functional"}
    return {"tests": [test], "fn_name": fn}


def taco(fn: str, args: list, output: object) -> dict:
    return {"inputs": [args], "outputs": [output], "fn_name": fn}


def returns(value: str, fn: str = "f", params: str = "*args") -> str:
    return f"def {fn}({params}):\n    return {value}\n"


def prints(text: str) -> str:
    return f"print({text!r})\n"


# Finds the nonce where a program can read it (frames, environment, /proc) and writes forged
# or malformed reports on every descriptor it has, after ``before``; then ``after``.
FORGE = r"""import os, re, sys
found = set()
frame = sys._getframe()
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for value in list(scope.values()):
            if isinstance(value, str):
                found.update(re.findall(r"[0-9a-f]{16}", value))
    frame = frame.f_back
for value in os.environ.values():
    found.update(re.findall(r"[0-9a-f]{16}", value))
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        text = open("/proc/%s/cmdline" % pid, "rb").read().decode("latin-1")
        found.update(re.findall(r"[0-9a-f]{16}", text))
    except OSError:
        pass
BEFORE
frames = [FRAMES]
for fd in map(int, os.listdir("/proc/self/fd")):
    if fd > 2:
        for data in frames:
            try:
                os.write(fd, data)
            except OSError:
                pass
AFTER
"""


def forge(frames: str, before: str = "print(7, flush=True)", after: str = "os._exit(1)") -> str:
    return FORGE.replace("BEFORE", before).replace("FRAMES", frames).replace("AFTER", after)


def deep_body(depth: int) -> str:
    body = f"b'L' + b'[' * {depth} + b']' * {depth}"
    nonce_frames = f"b'%s 0 %d 0\\n' % (n.encode(), 1 + 2 * {depth}) + {body}"
    # The forged reports (with any nonce found) first, then the bare result.
    return f"{nonce_frames} for n in sorted(found)] + [{body}"


ALWAYS_EQUAL = (
    "class Anything:\n    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n    def __bool__(self):\n"
    "        return True\n"
)


def cases() -> list[dict]:  # noqa: PLR0915 - one table
    rows: list[dict] = []

    def add(cls: str, note: str, response: str, tests: object, expect: int, control: str = ""):
        n = sum(r["class"] == cls for r in rows) + 1
        rows.append(
            {
                "id": f"{cls}-{n}",
                "class": cls,
                "role": "control" if control else "probe",
                "expect": expect,
                "tests": tests,
                "response": response,
                "note": note + (f" (control: {control})" if control else ""),
            }
        )

    fact = math.factorial(200)
    big = 10**400
    # --- crashes: each must score, not raise ---
    add(
        "crash_big_int",
        "wrong 200!+1 for 200! (isclose overflowed)",
        respond(returns(f"{fact} + 1")),
        lcb("f", [1], fact),
        -1,
    )
    add("crash_big_int", "", respond(returns(str(fact))), lcb("f", [1], fact), 1, "200! itself")
    add(
        "crash_big_int",
        "10**400 for an expected 1.5",
        respond(returns("10**400")),
        lcb("f", [1], 1.5),
        -1,
    )
    add("crash_big_int", "", respond(returns("1.5")), lcb("f", [1], 1.5), 1, "1.5")
    add(
        "crash_big_int",
        "inf for an expected 10**400",
        respond(returns("float('inf')")),
        taco("f", [1], big),
        -1,
    )
    add("crash_big_int", "", respond(returns("10**400")), taco("f", [1], big), 1, "10**400")
    add(
        "crash_big_int",
        "an MBPP wrong big integer",
        respond(returns("2**2000 - 1")),
        ["assert f(1) == " + str(2**2000)],
        -1,
    )
    add(
        "crash_big_int",
        "",
        respond(returns("2**2000")),
        ["assert f(1) == " + str(2**2000)],
        1,
        "the power itself",
    )
    for note, frame in (
        ("a header code of --0", "b'x --0 0 0\\n'"),
        ("a 5000-digit length", "b'x 0 ' + b'9' * 5000 + b' 0\\n'"),
        ("a 5000-digit cpu time", "b'x 0 0 ' + b'9' * 5000 + b'\\n'"),
        (
            "the nonce from a frame, then --0",
            "b'%s --0 0 0\\n' % n.encode() for n in sorted(found)] + [b'x 0 0 0\\n'",
        ),
    ):
        add(
            "crash_report",
            f"malformed report: {note}, then exit 1",
            respond(forge(frame)),
            stdin_tests("7"),
            -1,
        )
    add("crash_report", "", respond("print(7)\n"), stdin_tests("7"), 1, "no report written")
    add(
        "crash_report",
        "",
        respond(forge("b''", after="pass")),
        stdin_tests("7"),
        1,
        "the same program writing nothing and exiting 0",
    )
    for depth in (900, 5000, 100_000):
        program = forge(deep_body(depth), before="def f(x):", after="    os._exit(0)")
        program = program.replace("\nfor fd", "\n    for fd").replace(
            "\n    if fd > 2", "\n        if fd > 2"
        )
        program = (
            program.replace("\n        for data", "\n            for data")
            .replace(
                "\n            try:\n                os.write",
                "\n                try:\n                    os.write",
            )
            .replace(
                "\n            except OSError:\n                pass\n    os._exit",
                "\n                except OSError:\n                    pass\n    os._exit",
            )
        )
        program = program.replace("frames = [", "    frames = [")
        add(
            "crash_nesting",
            f"a result nested {depth} deep written on the report pipes",
            respond(program),
            taco("f", [1], [[1]]),
            -1,
        )
    nested = "[" * 50 + "1" + "]" * 50
    add(
        "crash_nesting",
        "",
        respond(returns(nested)),
        lcb("f", [1], json.loads(nested)),
        1,
        "a result nested 50 deep returned",
    )
    add("crash_nesting", "", respond(returns("[[1]]")), taco("f", [1], [[1]]), 1, "[[1]]")
    # --- false positives ---
    for got, want, kind in (
        ("1000000008", "1000000007", "stdout"),
        ("123456789013", "123456789012", "stdout"),
        ("1000000008", 1000000007, "lcb"),
        ("999999999999", 1000000000000, "mbpp"),
    ):
        for value, expect, control in ((got, -1, ""), (str(want), 1, "the exact integer")):
            if kind == "stdout":
                add(
                    "int_tolerance",
                    f"off by one on {want}",
                    respond(prints(value)),
                    stdin_tests(want),
                    expect,
                    control,
                )
            elif kind == "lcb":
                add(
                    "int_tolerance",
                    f"off by one on {want}",
                    respond(returns(value)),
                    lcb("f", [1], want),
                    expect,
                    control,
                )
            else:
                add(
                    "int_tolerance",
                    f"off by one on {want}",
                    respond(returns(value)),
                    [f"assert f(1) == {want}"],
                    expect,
                    control,
                )
    ten_400 = "1" + "0" * 400
    for got, want in (
        ("inf", ten_400),
        ("Infinity", ten_400),
        ("1e999", "1e400"),
        ("-inf", "-1e500"),
        ("1" + "0" * 399 + "1", ten_400),
    ):
        add(
            "non_finite",
            f"{got[:12]} for {want[:12]}... (equal after float())",
            respond(prints(got)),
            stdin_tests(want),
            -1,
        )
    add("non_finite", "", respond(prints(ten_400)), stdin_tests(ten_400), 1, "the digits")
    add("non_finite", "", respond(prints("1e400")), stdin_tests("1e400"), 1, "the same token")
    add("non_finite", "nan for 0.5", respond(returns("float('nan')")), lcb("f", [1], 0.5), -1)
    add("non_finite", "", respond(returns("0.5")), lcb("f", [1], 0.5), 1, "0.5")
    for got, want in (
        ("1_000", "1000"),
        ("\u0661\u0660\u0660\u0660", "1000"),
        ("\uff11\uff10\uff10\uff10", "1000"),
        ("1_000.5", "1000.5"),
        ("\u0967\u0968", "12"),
    ):
        add(
            "python_number",
            f"{got!r} is not a number a judge reads",
            respond(prints(got)),
            stdin_tests(want),
            -1,
        )
        add("python_number", "", respond(prints(want)), stdin_tests(want), 1, "ASCII digits")
    add(
        "only_element",
        "5 for LiveCodeBench's [5] (exact there)",
        respond(returns("5")),
        lcb("f", [1], [5]),
        -1,
    )
    add("only_element", "", respond(returns("[5]")), lcb("f", [1], [5]), 1, "[5]")
    add(
        "only_element",
        "[1, 2] for LiveCodeBench's [[1, 2]]",
        respond(returns("[1, 2]")),
        lcb("f", [1], [[1, 2]]),
        -1,
    )
    add("only_element", "", respond(returns("[[1, 2]]")), lcb("f", [1], [[1, 2]]), 1, "[[1, 2]]")
    canonical = [{"input": "[1]", "output": "[5]", "fn_name": "f"}]
    add("only_element", "5 for a canonical test's [5]", respond(returns("5")), canonical, -1)
    add(
        "only_element",
        "5 for TACO's [5, 6] (its grader's outputs[0])",
        respond(returns("5")),
        taco("f", [1], [5, 6]),
        -1,
    )
    add(
        "only_element",
        "",
        respond(returns("5")),
        taco("f", [1], [5]),
        1,
        "5 for TACO's [5]: its grader accepts outputs[0]",
    )
    for got, line in (
        ("1", "assert f(2) is True"),
        ("0", "assert f(2) is False"),
        ("1.0", "assert f(2) is True"),
    ):
        add("mbpp_is", f"{got} for '{line}'", respond(returns(got)), [line], -1)
        right = "True" if "True" in line else "False"
        add("mbpp_is", "", respond(returns(right)), [line], 1, right)
    # --- attacks on the harness (contained before issue 45: they must stay so) ---
    add(
        "harness_attack",
        "an object equal to everything",
        respond(ALWAYS_EQUAL + "def f(x):\n    return Anything()\n"),
        lcb("f", [1], [1, 2]),
        -1,
    )
    add(
        "harness_attack",
        "an int subclass equal to everything",
        respond(
            "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
            "def f(x):\n    return I(3)\n"
        ),
        lcb("f", [1], 4),
        -1,
    )
    add(
        "harness_attack",
        "a str subclass equal to everything (MBPP)",
        respond(
            "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
            "def f(x):\n    return S('no')\n"
        ),
        ["assert f(1) == 'yes'"],
        -1,
    )
    add(
        "harness_attack",
        "an always-true object for MBPP's bare assert",
        respond(
            ALWAYS_EQUAL.replace("True\n\n", "True\n", 0) + "def f(x):\n    return Anything()\n"
        ),
        ["assert f(1)"],
        -1,
    )
    add(
        "harness_attack",
        "exit 0 before any output",
        respond("import os\nos._exit(0)\n"),
        stdin_tests("7"),
        -1,
    )
    add(
        "harness_attack",
        "exit 0 instead of returning",
        respond("import os\ndef f(x):\n    os._exit(0)\n"),
        lcb("f", [1], 1),
        -1,
    )
    add(
        "harness_attack",
        "patch what an in-process comparison would use (==, isinstance, json, ast), return 5",
        respond(
            "import ast, builtins, json\nbuiltins.isinstance = lambda *a: True\n"
            "json.loads = lambda *a, **k: 4\nast.literal_eval = lambda *a: 4\n"
            "class Five(int):\n    def __eq__(self, o):\n        return True\n"
            "    __hash__ = int.__hash__\n"
            "def f(x):\n    return Five(5)\n"
        ),
        lcb("f", [1], 4),
        -1,
    )
    add(
        "harness_attack",
        "forged reports with any nonce found, then exit 1",
        respond(forge("b'%s 0 0 0\\n' % n.encode() for n in sorted(found) + ['0123456789abcdef']")),
        stdin_tests("7"),
        -1,
    )
    for sig in ("SIGTERM", "SIGKILL"):
        add(
            "harness_attack",
            f"print the answer, {sig} the harness, never end",
            respond(
                f"import os, signal\nprint(7, flush=True)\nos.kill(os.getppid(), signal.{sig})\n"
                "while True:\n    pass\n"
            ),
            stdin_tests("7"),
            -1,
        )
    add("harness_attack", "", respond(returns("4")), lcb("f", [1], 4), 1, "4")
    # --- misses: right answers the grader must pay ---
    thread = (
        "import sys, threading\nsys.setrecursionlimit(1 << 20)\nthreading.stack_size(1 << 27)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
    )
    add(
        "miss_thread",
        "deep recursion in a worker thread with a larger stack",
        respond(
            thread + "def main():\n    print(depth(int(input())))\n"
            "t = threading.Thread(target=main)\nt.start()\nt.join()\n"
        ),
        stdin_tests("100000", "100000\n"),
        1,
    )
    add(
        "miss_thread",
        "",
        respond(
            thread + "def main():\n    print(depth(int(input())) + 1)\n"
            "t = threading.Thread(target=main)\nt.start()\nt.join()\n"
        ),
        stdin_tests("100000", "100000\n"),
        -1,
        "the same idiom, off by one",
    )
    add(
        "miss_thread",
        "a functional test answered from a thread",
        respond(
            thread + "def f(n):\n    out = []\n    t = threading.Thread(target=lambda: "
            "out.append(depth(n)))\n    t.start()\n    t.join()\n    return out[0]\n"
        ),
        lcb("f", [50000], 50000),
        1,
    )
    add(
        "miss_thread",
        "",
        respond(
            thread + "def f(n):\n    out = []\n    t = threading.Thread(target=lambda: "
            "out.append(depth(n) * 2))\n    t.start()\n    t.join()\n    return out[0]\n"
        ),
        lcb("f", [50000], 50000),
        -1,
        "the same idiom, wrong",
    )
    add(
        "miss_thread",
        "a thread pool",
        respond(
            "from concurrent.futures import ThreadPoolExecutor\n"
            "with ThreadPoolExecutor(4) as pool:\n    print(sum(pool.map(abs, [-1, -2, 3])))\n"
        ),
        stdin_tests("6"),
        1,
    )
    add(
        "miss_thread",
        "",
        respond(
            "from concurrent.futures import ThreadPoolExecutor\n"
            "with ThreadPoolExecutor(4) as pool:\n    print(sum(pool.map(int, [-1, -2, 3])))\n"
        ),
        stdin_tests("6"),
        -1,
        "a thread pool, wrong",
    )
    solution = "def add(a, b):\n    return a + b\n"
    add(
        "miss_usage_block",
        "a functional solution, then a usage block",
        respond(solution, "print(add(2, 3))  # 5\n"),
        ["assert add(1, 2) == 3"],
        1,
    )
    add(
        "miss_usage_block",
        "",
        respond(solution.replace("+", "-"), "print(add(2, 3))\n"),
        ["assert add(1, 2) == 3"],
        -1,
        "a wrong solution, then a usage block",
    )
    add(
        "miss_usage_block",
        "class Solution, then a usage block",
        respond(
            "class Solution:\n    def twoSum(self, a, b):\n        return [a, b]\n",
            "print(Solution().twoSum(1, 2))\n",
        ),
        lcb("twoSum", [1, 2], [1, 2]),
        1,
    )
    add(
        "miss_usage_block",
        "",
        respond(
            "class Solution:\n    def twoSum(self, a, b):\n        return [b, a]\n",
            "print(Solution().twoSum(1, 2))\n",
        ),
        lcb("twoSum", [1, 2], [1, 2]),
        -1,
        "class Solution wrong, then a usage block",
    )
    reader = "a, b = map(int, input().split())\nprint(a + b)\n"
    add(
        "miss_usage_block",
        "a stdin program, then the sample worked by hand",
        respond(reader, "# sample: 3 4 -> 7\nprint(7)\n"),
        stdin_tests("8", "5 3\n"),
        1,
    )
    add(
        "miss_usage_block",
        "",
        respond(reader.replace("+", "*"), "print(8)\n"),
        stdin_tests("8", "5 3\n"),
        -1,
        "a wrong stdin program, then a block printing the answer",
    )
    for value, falsy in (("[x]", "[]"), ("x", "0"), ("'yes'", "''")):
        add(
            "miss_mbpp_truthy",
            f"{value} for a bare assert",
            respond(returns(value, params="x")),
            ["assert f(2)"],
            1,
        )
        add(
            "miss_mbpp_truthy",
            "",
            respond(returns(falsy, params="x")),
            ["assert f(2)"],
            -1,
            f"{falsy} for a bare assert",
        )
    # --- second reading: a program's stderr read as the box's failure (an "error" status
    # counts against reward.max_error_fraction and can stop the run) ---
    kill = (
        "import os, signal, sys\nsys.stderr.write('bwrap: Can not mount tmpfs\\n')\n"
        "sys.stderr.flush()\nPRINT"
        "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n"
        "while True:\n    pass\n"
    )
    add(
        "error_forgery",
        "'bwrap:' on stderr, then SIGKILL the harness (pidfd: no audit event)",
        respond(kill.replace("PRINT", "")),
        stdin_tests("7"),
        -1,
    )
    add(
        "error_forgery",
        "the answer printed, 'bwrap:' on stderr, SIGKILL the harness",
        respond(kill.replace("PRINT", "print(7, flush=True)\n")),
        stdin_tests("7"),
        -1,
    )
    add(
        "error_forgery",
        "a functional test: 'bwrap:' on stderr, SIGKILL the harness",
        respond(
            "def f(x):\n"
            + "".join("    " + line + "\n" for line in kill.replace("PRINT", "").splitlines())
        ),
        lcb("f", [1], 4),
        -1,
    )
    add("error_forgery", "", respond(prints("7")), stdin_tests("7"), 1, "7")
    # --- second reading: zero-padded digits are text ("11" paid for "0011") ---
    for got, want in (
        ("11", "0011"),
        ("7", "007"),
        ("5 7", "05 07"),
        ("-5", "-05"),
        ("5.5", "05.50"),
    ):
        add("zero_padded", f"{got!r} for {want!r}", respond(prints(got)), stdin_tests(want), -1)
    add("zero_padded", "", respond(prints("0011")), stdin_tests("0011"), 1, "'0011'")
    add("zero_padded", "", respond(prints("007")), stdin_tests("7"), 1, "'007' for '7'")
    # --- second reading: a set is no list (sorted by repr it matched [10, 9]) ---
    add(
        "set_as_list",
        "{9, 10} for [10, 9]",
        respond(returns("{9, 10}")),
        lcb("f", [1], [10, 9]),
        -1,
    )
    add(
        "set_as_list",
        "frozenset for TACO's [10, 9]",
        respond(returns("frozenset({9, 10})")),
        taco("f", [1], [10, 9]),
        -1,
    )
    add("set_as_list", "{1, 2} for [1, 2]", respond(returns("{2, 1}")), lcb("f", [1], [1, 2]), -1)
    add("set_as_list", "", respond(returns("[10, 9]")), lcb("f", [1], [10, 9]), 1, "[10, 9]")
    # --- second reading: stdin readers the graded-block rule did not see, then a usage block
    # that reads nothing (graded instead of the solution) ---
    for reader in (
        "from sys import stdin\na, b = map(int, stdin.readline().split())\n",
        "import fileinput\na, b = map(int, next(fileinput.input()).split())\n",
        "import os\na, b = map(int, os.read(0, 1 << 16).split())\n",
    ):
        add(
            "miss_stdin_reader",
            reader.splitlines()[0],
            respond(reader + "print(a + b)\n", "# sample: 3 4 -> 7\nprint(7)\n"),
            stdin_tests("8", "5 3\n"),
            1,
        )
    add(
        "miss_stdin_reader",
        "",
        respond(
            "from sys import stdin\na, b = map(int, stdin.readline().split())\nprint(a * b)\n",
            "print(8)\n",
        ),
        stdin_tests("8", "5 3\n"),
        -1,
        "a wrong reader, then a block printing the answer",
    )
    # --- second reading: MBPP's math.isclose with an integer (compared exactly, as an int) ---
    for body, line in (
        ("return 0.1 + 0.2 - 0.3", "assert math.isclose(f(1), 0, abs_tol=1e-9)"),
        ("return (x ** 0.5) ** 2", "assert math.isclose(f(7), 7)"),
        ("return x * 0.1 * 10", "assert isclose(f(3), 3)"),
    ):
        add("miss_mbpp_isclose", line, respond(f"def f(x):\n    {body}\n"), [line], 1)
    add(
        "miss_mbpp_isclose",
        "",
        respond("def f(x):\n    return 6.9\n"),
        ["assert math.isclose(f(7), 7)"],
        -1,
        "6.9 for isclose(f(7), 7)",
    )
    # --- second reading: one MBPP isclose line's tolerance was every line's ---
    for first, body in (
        ("assert f(1) == 0.5", "return 1.4 if x == 1 else 100.0"),
        ("assert f(1) == 2.5", "return 2.52 if x == 1 else 100.0"),
        ("assert f(1) == [0.5, 1.5]", "return [0.55, 1.5] if x == 1 else 100.0"),
    ):
        lines = [first, "assert math.isclose(f(2), 100.0, abs_tol=1)"]
        note = f"{body.split()[1]} for '{first}' beside an isclose line with abs_tol=1"
        add("mbpp_tolerance", note, respond(f"def f(x):\n    {body}\n"), lines, -1)
    add(
        "mbpp_tolerance",
        "",
        respond("def f(x):\n    return 0.5 if x == 1 else 100.3\n"),
        ["assert f(1) == 0.5", "assert math.isclose(f(2), 100.0, abs_tol=1)"],
        1,
        "0.5, and 100.3 within the isclose line's abs_tol",
    )
    # --- second reading: LeetCode-style names used without their import (NameError) ---
    two_sum = lcb("twoSum", [[2, 7, 11, 15], 9], [0, 1])
    body = (
        "        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    for signature, note in (
        ("nums: List[int], target: int) -> List[int]", "List without 'from typing import'"),
        ("nums: List[int], target: int) -> Optional[List[int]]", "Optional and List"),
        ("nums: Deque[int], target: int) -> Tuple[int, int]", "Deque and Tuple"),
    ):
        program = f"class Solution:\n    def twoSum(self, {signature}:\n{body}"
        add("miss_leetcode_names", note, respond(program), two_sum, 1)
    add(
        "miss_leetcode_names",
        "defaultdict and deque without 'from collections import'",
        respond(
            "class Solution:\n    def twoSum(self, nums, target):\n"
            "        where = defaultdict(list)\n        order = deque(nums)\n"
            "        for i, x in enumerate(order):\n"
            "            if where[target - x]:\n                return [where[target - x][0], i]\n"
            "            where[x].append(i)\n"
        ),
        two_sum,
        1,
    )
    add(
        "miss_leetcode_names",
        "",
        respond(
            f"class Solution:\n    def twoSum(self, nums: List[int], target: int):\n{body}".replace(
                "[seen[target - x], i]", "[i, seen[target - x]]"
            )
        ),
        two_sum,
        -1,
        "the same idiom, indices swapped",
    )
    # --- second reading: a script's thread started and not joined (the interpreter waits for
    # it before the script ends; the runner ended at once, without its output) ---
    unjoined = (
        "import sys, threading\nsys.setrecursionlimit(1 << 20)\nthreading.stack_size(1 << 26)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def main():\n    print(depth(int(input())) + OFFSET)\nSTART\n"
    )
    for start, note in (
        ("threading.Thread(target=main).start()", "Thread(target=main).start(), no join"),
        ("t = threading.Thread(target=main)\nt.start()", "a started thread, no join"),
        ("threading.Thread(target=main).start()\nsys.exit(0)", "a started thread, then sys.exit"),
    ):
        program = unjoined.replace("START", start).replace("OFFSET", "0")
        add("miss_thread_unjoined", note, respond(program), stdin_tests("50000", "50000\n"), 1)
    add(
        "miss_thread_unjoined",
        "",
        respond(
            unjoined.replace("START", "threading.Thread(target=main).start()").replace(
                "OFFSET", "1"
            )
        ),
        stdin_tests("50000", "50000\n"),
        -1,
        "the same idiom, off by one",
    )
    # --- second reading: output written from an atexit function (a fast-output idiom; the
    # runner ended without running them) ---
    fast_io = (
        "import atexit, io, sys\n_buffer = io.StringIO()\nsys.stdout = _buffer\n"
        "@atexit.register\ndef _write():\n    sys.__stdout__.write(_buffer.getvalue())\n"
        "a, b = map(int, input().split())\nprint(a OP b)\nEND"
    )
    for note, program in (
        ("stdout collected and written from atexit", fast_io.replace("END", "")),
        ("the same, then sys.exit(0)", fast_io.replace("END", "sys.exit(0)\n")),
        (
            "atexit.register(print, answer)",
            "import atexit\na, b = map(int, input().split())\natexit.register(print, a OP b)\n",
        ),
    ):
        add("miss_atexit", note, respond(program.replace("OP", "+")), stdin_tests("8", "5 3\n"), 1)
    add(
        "miss_atexit",
        "",
        respond(fast_io.replace("END", "").replace("OP", "*")),
        stdin_tests("8", "5 3\n"),
        -1,
        "the idiom with a wrong answer",
    )
    return rows


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    rows = cases()
    about = {
        "about": "programs a policy would try against the code reward, with matched controls; "
        "'expect' is the reward a correct grader gives "
        "(tests/unit/rewards/test_rewards_code_adversarial.py)",
        "built_by": "tools/build_code_adversarial_suite.py, by hand for issue 45",
    }
    with open(out, "w") as f:
        f.write("# " + json.dumps(about) + "\n")
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} cases -> {out}")


if __name__ == "__main__":
    main()
