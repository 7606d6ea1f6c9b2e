"""The documentation: generated references current and complete, links that resolve."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_rl.config import reference
from megatron_rl.trainer import metric_keys

ROOT = Path(__file__).resolve().parents[3]


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    """docs/config.md and docs/metrics.md are what tools/gen_docs.py writes from the code."""
    for path, make in _gen_docs().pages().items():
        assert path.exists(), f"{path} missing: run python tools/gen_docs.py"
        assert path.read_text() == make(), f"{path} is stale: run python tools/gen_docs.py"


def test_a_changed_default_makes_the_config_page_stale(monkeypatch):
    from megatron_rl.config.sections import OptimizerConfig

    before = reference.markdown()
    monkeypatch.setattr(OptimizerConfig.__dataclass_fields__["lr"], "default", 1e-3)
    after = reference.markdown()
    assert before != after
    line = next(x for x in after.splitlines() if x.startswith("| `optimizer.lr` "))
    assert "`0.001`" in line and "peak (constant) learning rate." in line


def test_every_recipe_key_has_a_meaning_and_is_documented():
    docs = reference.keys()
    assert not [d.key for d in docs if not d.meaning.strip()]
    page = (ROOT / "docs" / "config.md").read_text()
    # Keys a hand-written recipe sets, from every level of the tree, are all there.
    for key in ("optimizer.lr", "rollout.weight_transport", "data.sources[].weight",
                "logging.wandb.mode", "model.moe.aux_loss_coeff", "cluster.segment"):  # fmt: skip
        assert f"| `{key}` |" in page, key
    # One row per leaf key of the defaults (a section is not a key).
    from megatron_rl.config.loader import to_dict
    from megatron_rl.config.schema import RunConfig

    def leaves(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            out |= leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return out

    assert leaves(to_dict(RunConfig())) <= {d.key for d in docs}


@dataclass
class _Undocumented:
    """A section.

    Attributes:
        known: a documented key.
    """

    known: int = 1
    unknown: int = 2
    # a comment documents this one
    commented: int = 3
    sub: list[int] = field(default_factory=list)


def test_a_key_without_a_description_is_found():
    got = {d.key: d.meaning for d in reference.keys(_Undocumented)}
    assert got == {
        "known": "a documented key.",
        "unknown": "",
        "commented": "a comment documents this one",
        "sub": "",
    }


def test_every_metric_has_a_meaning_and_a_unit():
    for key, (meaning, unit) in metric_keys.METRICS.items():
        assert meaning.strip() and unit.strip(), key


def test_patterns_match_one_segment_only():
    assert metric_keys.is_known("val_pass_rate/code")
    assert metric_keys.is_known("forecast_A_lo/math")
    assert metric_keys.is_known("moe/load_balancing_loss")
    assert not metric_keys.is_known("val_pass_rate/code/extra")
    assert not metric_keys.is_known("val_pass_rate_typo")
    assert metric_keys.unknown(["step", "no_such_key", "gpu_hours"]) == ["no_such_key"]


def test_step_record_keys_are_registered():
    """A step record built by the loop from a StepResult, the GPU-hours clock, a push and the
    scoring keys: every key is in the registry."""
    from types import SimpleNamespace

    from megatron_rl.rollout.samples import PushStats
    from megatron_rl.trainer.compute import ComputeClock
    from megatron_rl.trainer.loop import step_record
    from megatron_rl.trainer.step import StepResult

    result = StepResult(
        loss=0.1, grad_norm=1.0, effective_batch_fraction=0.5, rho_mean=1.0, rho_max=1.2,
        clip_frac=0.0, abs_logprob_diff=0.01, num_tokens=100,
    )  # fmt: skip
    push = PushStats(version=2, tensors=3, bytes=10**6, buckets=1, seconds=0.5, load_seconds=0.1)
    run = SimpleNamespace(clock=ComputeClock(devices=1), tracker=None)
    pool = SimpleNamespace(version=2, restarts=0)
    info = {"response_tokens": 10, "reward_mean": 0.5, "staleness_hist": [1, 2]}
    record = step_record(run, 1, info, result, 0.0, 1.0, 2.0, push, pool)
    assert {"gpu_hours", "total_gpu_hours", "validation_gpu_hours", "push_gb_per_s"} <= set(record)
    assert metric_keys.unknown(record) == []


def test_the_logger_warns_once_about_an_unregistered_key(tmp_path, caplog):
    from megatron_rl.trainer.metrics import MetricsLogger

    metrics = MetricsLogger(tmp_path, tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.metrics"):
        metrics.log({"step": 1, "gpu_hours": 0.0, "made_up_key": 1.0})
        metrics.log({"step": 2, "gpu_hours": 0.0, "made_up_key": 2.0})
    said = [r for r in caplog.records if "made_up_key" in r.getMessage()]
    assert len(said) == 1
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["made_up_key"] for x in lines] == [1.0, 2.0]  # never dropped


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "slurm" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lowercase, punctuation dropped)."""
    heads = re.findall(r"(?m)^#+ (.+)$", md.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_in_readme_and_docs_resolve():
    """Every relative link's file exists, and its #anchor is a heading of that file."""
    broken = []
    for md in _markdown_files():
        for target in _LINK.findall(md.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = md.parent / path if path else md
            if not file.exists() or (
                anchor and file.suffix == ".md" and anchor not in _anchors(file)
            ):
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_anchors_follow_github():
    md = ROOT / "docs" / "cluster.md"
    assert {"weights--biases", "slurm-jobs-gb200-nvl72", "first-hour-on-a-cluster-preflight"} <= (
        _anchors(md)
    )


def test_the_link_check_sees_a_broken_link(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("see [a](missing.md) and [b](x.md#top) and [c](https://example.org)\n")
    targets = [t for t in _LINK.findall(md.read_text()) if not re.match(r"^[a-z]+:", t)]
    assert [t for t in targets if not (tmp_path / t.split("#")[0]).exists()] == ["missing.md"]


@pytest.mark.parametrize("page", ["config.md", "metrics.md"])
def test_readme_or_docs_index_links_the_generated_pages(page):
    text = "\n".join(p.read_text() for p in _markdown_files() if p.name != page)
    assert f"{page})" in text
