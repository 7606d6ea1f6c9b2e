"""The loop's order around a stop on a signal (trainer/loop.py ``train``): the checkpoint
comes before a validation that may outlast the signal's window, a save in flight is published
before any validation, the resumed run validates what the stop put off; Ctrl-C (SIGINT) is a
stop, a second one stops at once. The trainer's own methods run; its steps are stand-ins."""

from __future__ import annotations

import contextlib
import os
import signal
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_run_config
from megatron_rl.trainer import loop, summary, validation
from megatron_rl.trainer.loop import StopFlag, Trainer
from megatron_rl.trainer.validation import OwedValidation, ValidationStopped

RECIPE = "recipes/tiny_cpu.yaml"


class Checkpoints:
    """The checkpoint manager as the loop sees it: an async save stays in flight until a
    finalize publishes it (a blocking one always; a non-blocking one once its write is done)."""

    def __init__(self, events: list, written_after: int) -> None:
        self.events, self.in_flight, self.written_after = events, None, written_after

    def finalize(self, blocking: bool = False) -> None:
        if self.in_flight is not None and (blocking or self.written_after <= 0):
            self.events.append(("published", self.in_flight))
            self.in_flight = None
        self.written_after -= 1


def make_trainer(config, events, step=0, signal_at=None, owed=None, written_after=99):
    """A Trainer of ``config`` at ``step`` whose batches, updates, pushes and saves record
    ``events``; a SIGUSR1 arrives during the update of step ``signal_at``."""
    trainer = Trainer.__new__(Trainer)
    checkpoints = Checkpoints(events, written_after)
    clock = SimpleNamespace(window=lambda name: contextlib.nullcontext(), begin=lambda name: None)
    trainer.config, trainer.step, trainer.main = config, step, True
    trainer.pool = trainer.waits = trainer.forecast = trainer.paid = None
    trainer.run = SimpleNamespace(checkpoints=checkpoints, clock=clock)
    trainer.stop = StopFlag(())
    trainer.owed = OwedValidation()
    trainer.owed.step = owed
    trainer.begin = lambda: events.append(("begin", trainer.step))
    trainer.next_batch = lambda: SimpleNamespace(wants_push=True)

    def update(batch):
        trainer.step += 1
        if trainer.step == signal_at:
            trainer.stop.requested = "SIGUSR1"

    def save_checkpoint(wait=False):
        events.append(("save", trainer.step, wait, trainer.owed.step))
        if not wait:
            checkpoints.in_flight = trainer.step
        else:
            events.append(("published", trainer.step))

    trainer.update = update
    trainer.push_weights = lambda wanted: (None, None)
    trainer.log_step = lambda *args: None
    trainer.save_checkpoint = save_checkpoint
    real_finish = trainer.finish
    trainer.finish = lambda: (events.append(("finish", trainer.step)), real_finish())[1]
    trainer.close = lambda finished: events.append(("close", finished))
    return trainer


@pytest.fixture
def run(monkeypatch):
    """train() on a stand-in trainer: (events, run(trainer) -> exit code)."""
    events: list = []
    monkeypatch.setattr(summary, "log_start", lambda *args: None)
    monkeypatch.setattr(summary, "log_end", lambda *args: None)
    monkeypatch.setattr(
        validation, "validate", lambda run, pool, step, *a, **k: events.append(("val", step))
    )

    def train(config, trainer) -> int:
        monkeypatch.setattr(loop, "Trainer", lambda *args: trainer)
        return loop.train(config, "unused")

    return events, train


def _config(*overrides: str):
    keys = ["validation.every_steps=2", "checkpoint.every_steps=3", "training.max_steps=6"]
    return load_run_config(RECIPE, keys + list(overrides), check_model=False)


def test_a_signal_before_a_validation_checkpoints_first_and_the_resume_validates(run):
    """The issue's run: a save written at step 3 (in flight), a validation due at 4, SIGUSR1
    during step 4. Before, step 4 was validated first (for longer than the signal's window
    at scale: then SIGKILL), with step 3's save complete on disk but never published; the
    requeued job started over. Now: no validation, step 4's checkpoint (which says the
    validation is owed), exit 0; the resumed run validates step 4 before step 5."""
    events, train = run
    config = _config("validation.at_start=false")
    assert train(config, make_trainer(config, events, signal_at=4)) == 0
    saves = [e for e in events if e[0] == "save"]
    assert saves == [("save", 3, False, None), ("save", 4, True, 4)]  # step 4's owes its val
    assert [e[1] for e in events if e[0] == "val"] == [2]
    assert events[-1] == ("close", False)

    events.clear()  # the requeued job, resumed from step 4's checkpoint
    resumed = make_trainer(config, events, step=4, owed=4)
    assert train(config, resumed) == 0
    assert events[:2] == [("val", 4), ("begin", 4)]
    assert [e[1] for e in events if e[0] == "val"] == [4, 6]
    assert resumed.owed.step is None  # validated: step 6's save owes nothing


def test_a_save_in_flight_is_published_before_a_validation(run):
    """A validation can outlast a signal's window: the save written before it must be on
    disk as a checkpoint before it starts, not after it (its write may be done already)."""
    events, train = run
    config = _config("validation.at_start=false")
    train(config, make_trainer(config, events))
    assert events.index(("published", 3)) < events.index(("val", 4))


def _stopped_validation(events, trainer, at: int):
    """A stand-in ``validation.validate`` whose first pass at step ``at`` is signalled
    midway: it gives up as the real one does when ``stopped()`` (``ValidationStopped``)."""
    signalled = []

    def validate(run_, pool, step, *args, stopped=None):
        events.append(("val", step))
        if step == at and not signalled:
            signalled.append(step)
            trainer.stop.requested = "SIGTERM"
            assert stopped is not None and stopped()  # the loop asks for the stop flag
            events.append(("val stopped", step))
            raise ValidationStopped(f"the validation of step {step} was stopped")

    return validate


def test_a_signal_during_a_validation_stops_it_checkpoints_and_the_resume_validates(
    run, monkeypatch
):
    """A signal that comes during a validation (longer than the signal's window at scale)
    gives it up: the checkpoint of that step owes it, exit 0; the resumed run validates that
    step before its next. Before, the whole pass ran first (then SIGKILL: no checkpoint)."""
    events, train = run
    config = _config("validation.at_start=false")
    trainer = make_trainer(config, events)
    monkeypatch.setattr(validation, "validate", _stopped_validation(events, trainer, at=2))
    assert train(config, trainer) == 0
    assert events[1:] == [
        ("val", 2),
        ("val stopped", 2),
        ("save", 2, True, 2),  # it owes step 2's validation
        ("published", 2),
        ("close", False),
    ]
    events.clear()  # the requeued job, resumed from step 2's checkpoint
    resumed = make_trainer(config, events, step=2, owed=2)
    assert train(config, resumed) == 0
    assert events[:2] == [("val", 2), ("begin", 2)]
    assert [e[1] for e in events if e[0] == "val"] == [2, 4, 6]


def test_a_signal_during_a_resumed_runs_owed_validation_stops_before_training(run, monkeypatch):
    """The owed validation at a resumed run's start, signalled in turn: the job stops
    before its first step without a save (its checkpoint, the latest, owes it still); with
    no checkpoint yet (step 0's validation) step 1 is trained and checkpointed first."""
    events, train = run
    config = _config()
    resumed = make_trainer(config, events, step=2, owed=2)
    monkeypatch.setattr(validation, "validate", _stopped_validation(events, resumed, at=2))
    assert train(config, resumed) == 0
    assert events == [("val", 2), ("val stopped", 2), ("close", False)]
    assert resumed.owed.step == 2
    events.clear()
    fresh = make_trainer(config, events)
    monkeypatch.setattr(validation, "validate", _stopped_validation(events, fresh, at=0))
    assert train(config, fresh) == 0
    assert events[:3] == [("val", 0), ("val stopped", 0), ("begin", 0)]
    assert ("save", 1, True, None) in events and events[-1] == ("close", False)


def test_a_signal_during_the_end_validation_checkpoints_and_the_run_is_not_finished(
    run, monkeypatch
):
    """The end's validation (the last step is not a validation step) signalled: the last
    step's checkpoint owes it and the run stops unfinished; the resumed run validates it
    once, at its start, trains nothing and ends finished with a checkpoint that owes none."""
    events, train = run
    config = _config("validation.at_start=false", "training.max_steps=5")
    trainer = make_trainer(config, events)
    monkeypatch.setattr(validation, "validate", _stopped_validation(events, trainer, at=5))
    assert train(config, trainer) == 0
    assert ("save", 5, True, 5) in events and events[-1] == ("close", False)
    events.clear()
    resumed = make_trainer(config, events, step=5, owed=5)
    assert train(config, resumed) == 0
    assert [e for e in events if e[0] == "val"] == [("val", 5)]  # once, not again at the end
    assert ("save", 5, True, None) in events and events[-1] == ("close", True)


def test_ctrl_c_stops_after_a_checkpoint_and_a_second_one_at_once():
    """SIGINT is among the default stop signals: the first one sets the stop flag (the loop
    checkpoints at its next step and exits 0); a second raises KeyboardInterrupt at once.
    Before: the first Ctrl-C raised KeyboardInterrupt mid-step, nothing was saved, exit 130."""
    config = load_run_config(RECIPE, [], check_model=False)
    assert "SIGINT" in config.checkpoint.on_signals
    previous = signal.getsignal(signal.SIGINT)
    try:
        stop = StopFlag(config.checkpoint.on_signals)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested == "SIGINT" and not stop.interrupted
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_validation_owed_at_the_last_step_is_checkpointed_once_paid(run):
    """A stop at the last step (a checkpoint and a validation both due): the resumed run
    validates it and trains nothing; its end checkpoints again, or the checkpoint would
    still owe the validation, and a later resume with more steps would validate it twice."""
    events, train = run
    config = _config("validation.at_start=false")
    assert train(config, make_trainer(config, events, step=6, owed=6)) == 0
    assert events[:2] == [("val", 6), ("begin", 6)]
    assert ("save", 6, True, None) in events


def test_a_stop_leaves_the_hf_exports_to_the_next_run_and_an_end_waits_for_them(run):
    """close() after a stop interrupts the exports (kept for the next run's resume); before,
    it waited 0 s, killed the running export and counted it failed. A normal end waits."""
    from megatron_rl.trainer import hf_export

    config = _config()
    calls = []
    for finished in (False, True):
        trainer = make_trainer(config, [])
        del trainer.close  # the real one
        trainer.main, trainer.bar = False, None
        trainer.run = SimpleNamespace(
            checkpoints=SimpleNamespace(abandon=lambda: calls.append("abandon")),
            clock=SimpleNamespace(begin=lambda name: None),
            rewards=SimpleNamespace(close=lambda: None),
            metrics=SimpleNamespace(close=lambda: None),
            exporter=SimpleNamespace(
                interrupt=lambda: calls.append("interrupt"),
                close=lambda timeout: calls.append(("close", timeout)),
            ),
        )
        trainer.close(finished)
    assert calls == ["abandon", "interrupt", "abandon", ("close", hf_export.FINAL_WAIT_SECONDS)]


def test_a_second_ctrl_c_is_one_line_and_status_130(monkeypatch, tmp_path, capsys):
    """Before: a KeyboardInterrupt traceback (40 lines a rank) and "failed"."""
    import argparse

    from megatron_rl.trainer import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("a second SIGINT")

    monkeypatch.setattr(loop, "train", interrupted)
    args = argparse.Namespace(
        recipe=RECIPE,
        overrides=[],
        dry_run=False,
        run_dir=str(tmp_path / "run"),
        restart=False,
        quiet=False,
        allow_changes=False,
    )
    assert cli.run(args) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted (Ctrl-C twice): stopped at once" in err
