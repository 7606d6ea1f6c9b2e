"""Engine idle fraction with tool calls (issue 38): multi-turn episodes against single-turn
samples on the real vLLM CPU engine, printed side by side.

What runs. One ``VLLMEngine`` (a random tiny-llama made at start, no download) driven by an
``EngineRunner`` exactly as an engine process drives it, with ``EnvironmentSteps`` over the
``python_tool`` environment: every tool call is a real ``run_python`` in its own code-sandbox
box on a ``ToolExecutor`` thread, its output tokenized once and appended by id. The driver
keeps ``concurrency`` episodes in flight (a finished one is replaced at once, as the
generator pool tops up) until ``--episodes`` per run have finished (default: twice the
concurrency, at least 4).

How a random model makes tool calls. It writes no ``<|python_tag|>`` and no Python, so the
benchmark's tool format (``IdleBenchFormat``, Llama-3.1's observation wrapper) makes the stop
ids of a turn a few ordinary ids that the near-uniform random model emits: with ``k`` of the
128 ids a turn ends after about 128 / k tokens (``--turn-tokens`` sets k), and every turn that
ends on one of them calls the tool with the fixed program ``--code`` (default: half a second
of sleep and a small computation printing one line; the model's text is not run). The same stop ids end the single-turn
samples (``max_turns`` 1: the first stop ends the sample), so both runs generate turns of the
same length; the difference is what happens between turns.

Measured per run (``max_turns`` x concurrency):
- requests: vLLM requests (one per model turn), turns per episode, tool calls, tool seconds
  (the calls' own run time, summed);
- engine steps: ``engine.step()`` calls that had work;
- idle fraction: the share of the run's wall time in which the engine had no request to step
  (``has_work()`` false before a runner step: its episodes were all waiting on tools, or
  between an episode's end and its replacement), i.e. what tool latency costs the engine;
- tokens/s: model tokens generated per second of wall time (tool tokens not counted).

On a 2-core machine the sandboxes take CPU from the engine (on a cluster node they run on
other cores), and the machine is shared: compare the two columns of one run, not runs.

Usage: python tools/bench_tool_idle.py [--concurrency 1 8 32] [--episodes N] [--max-turns 4]
       [--turn-tokens 24] [--tool-workers N] [--code PROGRAM]
"""

from __future__ import annotations

import argparse
import logging
import queue
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from megatron_rl.environments.formats import Llama3Format, ToolCall

# Half a second of latency, little CPU: a tool call of typical length (a sympy import alone
# takes ~0.5-1 s) that does not take this 2-core machine's cores from the engine, as a call
# on a cluster's engine node runs on cores of its own. --code runs anything else.
DEFAULT_CODE = "import time; time.sleep(0.5); print(sum(i * i for i in range(10**5)))"
FIRST_ID = 7  # the character tokenizer's ordinary ids start here (ids 0-6: specials)


class IdleBenchFormat(Llama3Format):
    """Stop ids a random model emits: every turn that ends on one of ``ids`` is a call of
    ``code`` (see the module docstring); the output is appended after a newline (Llama's
    header tokens would be ~70 characters of the 128-id character vocabulary per call)."""

    name = "idle_bench"

    def __init__(self, ids: list[int], code: str) -> None:
        super().__init__()
        self.ids, self.code = list(ids), code

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        return list(self.ids)

    def parse_ids(self, token_ids, tokenizer: Any) -> ToolCall | None:
        return ToolCall(self.code, text=f"<{len(token_ids)} random tokens>")

    def observation_text(self, output: str) -> str:
        return "\n" + output


class TimedEngine:
    """The engine, counting its requests and steps and the time it had no request to step:
    from a step that leaves it without work to the next request added."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps = 0
        self.requests = 0
        self.idle_s = 0.0
        self.idle_since: float | None = time.perf_counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add(self, *args, **kwargs) -> None:
        self.requests += 1
        if self.idle_since is not None:
            self.idle_s += time.perf_counter() - self.idle_since
            self.idle_since = None
        self.engine.add(*args, **kwargs)

    def step(self):
        self.steps += 1
        deltas = self.engine.step()
        if not self.engine.has_work():
            self.idle_since = time.perf_counter()
        return deltas


@dataclass
class RunResult:
    max_turns: int
    concurrency: int
    episodes: int
    requests: int
    turns: float
    tool_calls: int
    tool_seconds: float
    steps: int
    idle_fraction: float
    tokens_per_s: float
    wall_s: float


def run_once(
    engine,
    tokenizer,
    fmt: IdleBenchFormat,
    max_turns: int,
    concurrency: int,
    episodes: int,
    max_tokens: int,
    tool_workers: int,
    seed: int,
    progress=None,
) -> RunResult:
    """Keep ``concurrency`` episodes in flight on ``engine`` until ``episodes`` finished."""
    from megatron_rl.environments.config import EnvironmentConfig
    from megatron_rl.environments.episodes import EnvironmentSteps
    from megatron_rl.environments.protocol import EnvironmentContext
    from megatron_rl.environments.python_tool import PythonToolEnvironment
    from megatron_rl.environments.tools import ToolExecutor
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.engine.runner import EngineRunner
    from megatron_rl.rollout.messages import RequestSpec, RunnerSettings, SamplesDone

    reward = RewardConfig(kind="math", num_workers=1)
    env_config = EnvironmentConfig(name="python_tool", tool_format="llama3")
    context = EnvironmentContext(env_config, reward, tokenizer, max_turns=max(max_turns, 2))
    timed = TimedEngine(engine)
    events: queue.Queue = queue.Queue()
    prompt = tuple(tokenizer.encode("12+34=", add_special_tokens=False))
    problem = SimpleNamespace(problem="12+34=", answer="46")
    with ToolExecutor(tool_workers, reward) as executor:
        steps = EnvironmentSteps(
            fmt,
            tokenizer,
            executor,
            lambda: PythonToolEnvironment(context),
            max_turns=max_turns,
        )
        # no end-of-text stop: a turn ends on the format's stop ids (or the budget)
        runner = EngineRunner(0, timed, RunnerSettings(()), events, steps)
        submitted = finished = 0
        samples = []

        def submit() -> None:
            nonlocal submitted
            runner.submit(
                RequestSpec(
                    prompt_index=submitted,
                    sample_index=0,
                    prompt_ids=prompt,
                    max_tokens=max_tokens,
                    temperature=1.0,
                    top_p=1.0,
                    seed=seed + submitted,
                    problem=problem,  # an episode (a request without one is single-turn)
                )
            )
            submitted += 1

        start = timed.idle_since = time.perf_counter()
        for _ in range(min(concurrency, episodes)):
            submit()
        while finished < episodes:
            runner.step()
            while not events.empty():
                event = events.get()
                if isinstance(event, SamplesDone):
                    samples += event.samples
                    finished += len(event.samples)
                    if progress is not None:
                        progress(len(event.samples))
                    for _ in event.samples:
                        if submitted < episodes:
                            submit()
        wall = time.perf_counter() - start
    calls = [call for sample in samples for call in sample.tools]  # (outcome, seconds)
    model_tokens = sum(sum(s.mask) for s in samples)
    return RunResult(
        max_turns=max_turns,
        concurrency=concurrency,
        episodes=len(samples),
        requests=timed.requests,
        turns=timed.requests / len(samples),
        tool_calls=len(calls),
        tool_seconds=sum(seconds for _, seconds in calls),
        steps=timed.steps,
        idle_fraction=timed.idle_s / wall,
        tokens_per_s=model_tokens / wall,
        wall_s=wall,
    )


def table(rows: list[tuple[RunResult, RunResult]]) -> str:
    """Single-turn and multi-turn runs side by side, one block per concurrency."""
    lines = []
    for single, multi in rows:
        head = (
            f"concurrency {single.concurrency}: {single.episodes} episodes   "
            f"max_turns={single.max_turns:<4}  max_turns={multi.max_turns}"
        )
        lines.append(head)
        for label, get, fmt in (
            ("requests", lambda r: r.requests, "{:d}"),
            ("turns / episode", lambda r: r.turns, "{:.2f}"),
            ("tool calls", lambda r: r.tool_calls, "{:d}"),
            ("tool seconds", lambda r: r.tool_seconds, "{:.2f}"),
            ("engine steps", lambda r: r.steps, "{:d}"),
            ("idle fraction", lambda r: r.idle_fraction, "{:.3f}"),
            ("tokens/s", lambda r: r.tokens_per_s, "{:.0f}"),
            ("wall s", lambda r: r.wall_s, "{:.1f}"),
        ):
            lines.append(
                f"  {label:<22}{fmt.format(get(single)):>12}  {fmt.format(get(multi)):>12}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes per run (default: 2 x concurrency, at least 4)",
    )
    parser.add_argument("--max-turns", type=int, default=4, help="of the multi-turn runs")
    parser.add_argument("--turn-tokens", type=int, default=24, help="mean model turn length")
    parser.add_argument("--max-tokens", type=int, default=384, help="episode token budget")
    parser.add_argument(
        "--tool-workers",
        type=int,
        default=None,
        help="tool calls at once (default: the largest concurrency: no call queues)",
    )
    parser.add_argument("--code", default=DEFAULT_CODE, help="the program every call runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.max_turns < 2 or args.turn_tokens < 1 or (args.episodes or 1) < 1:
        parser.error("--max-turns must be >= 2, --turn-tokens and --episodes >= 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency must be >= 1")
    workers = args.tool_workers or max(args.concurrency)
    if not 0 < args.max_tokens <= 500:
        parser.error("--max-tokens must be in [1, 500]: tiny-llama has 512 positions")
    logging.basicConfig(level=logging.WARNING)

    from rich.progress import Progress

    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.models import make_hf_model, preset_hf_config
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rewards.isolation import box_for
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import VLLMEngine

    box_for(RewardConfig(kind="code"), announce=True)  # fail now if no sandbox can run
    root = tempfile.mkdtemp(prefix="bench_tool_idle_")
    tokenizer = build_char_tokenizer(f"{root}/tok")
    hf_dir = make_hf_model(preset_hf_config("tiny-llama"), f"{root}/model", 0, f"{root}/tok")
    vocab = preset_hf_config("tiny-llama").vocab_size
    count = max(1, round(vocab / args.turn_tokens))
    fmt = IdleBenchFormat(list(range(FIRST_ID, FIRST_ID + count)), args.code)
    config = RolloutConfig(
        dtype="float32",
        max_num_seqs=max(args.concurrency),
        max_model_len=512,  # tiny-llama's positions
        stop_token_ids=[],
        seed=args.seed,
    )
    engine = VLLMEngine(hf_dir, config)
    rows = []
    try:
        with Progress() as progress:
            for concurrency in args.concurrency:
                pair = []
                episodes = args.episodes or max(4, 2 * concurrency)
                for turns in (1, args.max_turns):
                    task = progress.add_task(
                        f"max_turns={turns} concurrency={concurrency}", total=episodes
                    )
                    pair.append(
                        run_once(
                            engine,
                            tokenizer,
                            fmt,
                            turns,
                            concurrency,
                            episodes,
                            args.max_tokens,
                            workers,
                            args.seed,
                            lambda n, task=task: progress.advance(task, n),
                        )
                    )
                rows.append(tuple(pair))
    finally:
        engine.close()
    print(
        f"tiny-llama (random, vocab {vocab}) on the vLLM CPU engine; turns end on {count} "
        f"stop ids (~{vocab / count:.0f} tokens); every call runs {args.code!r} in the "
        f"sandbox; {workers} tool workers; budget {args.max_tokens} tokens"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
