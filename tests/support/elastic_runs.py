"""What a run with a SIGKILLed engine must show, in process or under Slurm (tests)."""

from __future__ import annotations


def assert_killed_in_time(max_steps: int, logged: int, k: int) -> None:
    """The last batches must be submitted after the kill, else the run may end before the
    death is seen: batch n (trained at version n - 1, lag <= k) is submitted at version
    >= n - 1 - k, and the version at the kill is at most the steps logged then + 1."""
    assert max_steps > logged + 1 + k + 1, f"killed too late (step {logged}) to test"


def assert_every_prompt_trained_once(
    steps: list[dict], max_steps: int, k: int, prompts: int, samples: int, restarts: int = 1
) -> None:
    """The step records of a run whose engine was killed: every step logged once,
    ``restarts`` restarts counted by the end, at least ``prompts`` (B) prompts a step and
    none trained twice, whole groups of ``samples`` (G) each, and the lag bound ``k``."""
    assert [r["step"] for r in steps] == list(range(1, max_steps + 1))
    assert steps[0]["engine_restarts"] == 0 and steps[-1]["engine_restarts"] == restarts
    trained = [pid for r in steps for pid in r["prompt_ids"]]
    assert len(trained) == len(set(trained)) >= prompts * max_steps
    assert all(r["samples"] == samples * len(r["prompt_ids"]) for r in steps)
    assert all(r["staleness_max"] <= k for r in steps)
