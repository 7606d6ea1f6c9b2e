"""Math + code mixtures: the exact mix of the sampler, its resume, per-source loading and
validation splits, the synthetic code task, reward routing by domain, per-domain validation
records, TensorBoard curves and the reward-curve plot."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from megatron_rl.data import (
    DataConfig,
    DataSourceConfig,
    MixedPromptSampler,
    PromptSampler,
    SyntheticCodeConfig,
    SyntheticConfig,
    build_sampler,
    load_prompt_data,
)
from megatron_rl.data.synthetic_code import generate_code_problems

MATH_IDS = list(range(10))
CODE_IDS = list(range(100, 107))


def mixed(weights=(3, 1), tracker=None, seed=0) -> MixedPromptSampler:
    return MixedPromptSampler(
        [("math", MATH_IDS, weights[0]), ("code", CODE_IDS, weights[1])],
        seed=seed,
        tracker=tracker,
    )


def test_mix_is_exact_in_every_window_and_each_source_keeps_its_epochs():
    drawn = mixed((3, 1)).next_prompts(400)
    for start in range(0, 400, 4):  # every cycle of sum(weights) = 4 draws: 3 math, 1 code
        assert sum(i < 100 for i in drawn[start : start + 4]) == 3
    math = [i for i in drawn if i < 100]
    code = [i for i in drawn if i >= 100]
    # Each source's own epochs are permutations of its training ids, reshuffled each epoch.
    for ids, stream in ((MATH_IDS, math), (CODE_IDS, code)):
        epochs = [stream[k : k + len(ids)] for k in range(0, len(stream) - len(ids) + 1, len(ids))]
        assert all(sorted(e) == ids for e in epochs)
        assert len({tuple(e) for e in epochs}) > 1


def test_fractional_weights_stay_within_one_prompt_at_every_point():
    sampler = MixedPromptSampler([("a", range(13), 0.7), ("b", range(50, 55), 0.3)])
    count = 0
    for n in range(1, 301):
        count += sampler.next_prompts(1)[0] < 50
        assert abs(count - 0.7 * n) < 1.0
    assert sampler.drawn_by_source() == {"a": count, "b": 300 - count}


def test_mixed_sampler_resumes_exactly_through_json():
    reference = mixed((2, 1), seed=5)
    expected = reference.next_prompts(137)
    first = mixed((2, 1), seed=5)
    head = first.next_prompts(37)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = mixed((2, 1), seed=5)
    resumed.load_state_dict(state)
    assert head + resumed.next_prompts(100) == expected
    assert resumed.num_drawn == 137


def test_mixed_sampler_state_is_checked():
    state = mixed((3, 1)).state_dict()
    with pytest.raises(ValueError, match="mixture"):
        mixed((1, 1)).load_state_dict(state)
    with pytest.raises(ValueError, match="overlap"):
        MixedPromptSampler([("a", [1, 2], 1), ("b", [2, 3], 1)])


class Retired:
    def __init__(self, ids):
        self.ids = set(ids)

    def is_retired(self, prompt_id: int) -> bool:
        return prompt_id in self.ids


def test_no_positive_resampling_per_prompt_and_an_exhausted_source_leaves_the_mix():
    sampler = mixed((1, 1), tracker=Retired({3, 101}))
    drawn = sampler.next_prompts(60)
    assert 3 not in drawn and 101 not in drawn
    assert Counter(i < 100 for i in drawn) == {True: 30, False: 30}
    sampler.tracker = Retired(set(CODE_IDS))  # every code prompt retired
    assert all(i < 100 for i in sampler.next_prompts(20))
    sampler.tracker = Retired(set(CODE_IDS) | set(MATH_IDS))
    with pytest.raises(RuntimeError, match="retired"):
        sampler.next_prompts(1)


def joint_config(tmp_path, **overrides) -> DataConfig:
    return DataConfig(
        cache_dir=str(tmp_path),
        sources=[
            DataSourceConfig(
                source="synthetic",
                name="math",
                weight=1,
                val_size=12,
                synthetic=SyntheticConfig(num_problems=80),
            ),
            DataSourceConfig(
                source="synthetic_code",
                name="code",
                weight=1,
                val_size=8,
                synthetic_code=SyntheticCodeConfig(max_constant=9, num_tests=2),
            ),
        ],
        **overrides,
    )


def test_a_mixture_loads_each_domain_with_its_own_validation_split(tmp_path):
    data = load_prompt_data(joint_config(tmp_path))
    assert [(s.name, s.domain) for s in data.sources] == [("math", "math"), ("code", "code")]
    assert len(data.prompts) == 80 + 50  # 5 templates x 10 constants
    assert [p.prompt_id for p in data.prompts] == list(range(130))
    assert {p.kind for p in data.prompts[:80]} == {"math"}
    assert {p.kind for p in data.prompts[80:]} == {"code"}
    assert all(p.answer is not None for p in data.prompts[:80])
    assert all(p.tests is not None and p.answer is None for p in data.prompts[80:])
    by_domain = data.val_by_domain()
    assert {k: len(v) for k, v in by_domain.items()} == {"math": 12, "code": 8}
    assert not set(data.val_ids) & set(data.train_ids)
    assert data.config_of(100).format == "deepcoder" and data.config_of(0).format == "polaris"
    sampler = build_sampler(data, joint_config(tmp_path))
    assert isinstance(sampler, MixedPromptSampler)
    kinds = [data.get(i).kind for i in sampler.next_prompts(40)]
    assert kinds == ["math", "code"] * 20


def test_a_single_source_is_unchanged(tmp_path):
    config = DataConfig(cache_dir=str(tmp_path), val_size=10)
    (source,) = config.resolve()
    assert source.config is config and source.domain == "math" and source.weight == 1.0
    data = load_prompt_data(config)
    assert isinstance(build_sampler(data, config), PromptSampler)
    assert {p.kind for p in data.prompts} == {"math"}


def test_mixture_config_errors_name_the_entry():
    with pytest.raises(ValueError, match=r"sources\[1\]\.weight"):
        DataConfig(
            sources=[DataSourceConfig("synthetic"), DataSourceConfig("x", weight=0)]
        ).validate()
    with pytest.raises(ValueError, match="used twice"):
        DataConfig(
            sources=[DataSourceConfig("synthetic"), DataSourceConfig("synthetic")]
        ).validate()


def test_synthetic_code_solutions_pass_their_tests_in_the_sandbox():
    from megatron_rl.rewards import RewardPool
    from megatron_rl.rewards.config import RewardConfig

    problems = generate_code_problems(SyntheticCodeConfig(max_constant=3, num_tests=2))
    assert len(problems) == 5 * 4 and len({p["problem"] for p in problems}) == 20
    picked = [p for p in problems if p["template"] in ("max", "diff")][:2]
    responses, refs = [], []
    for p in picked:
        wrong = (
            str(p["solution"]).replace("+", "*", 1)
            if "max" in p["problem"]
            else (str(p["solution"]).replace("a-b", "b-a"))
        )
        responses += [str(p["solution"]), wrong]
        refs += [{"tests": p["tests"], "fn_name": None}] * 2
    with RewardPool(RewardConfig(kind="code", num_workers=2)) as pool:
        assert pool.score_batch(responses, refs) == [1.0, -1.0, 1.0, -1.0]


# -- the loop's routing and per-domain validation (real rewards, fake generator) ----------


class TextTokenizer:
    """Token ids index a table of texts (the loop only decodes responses)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ids(self, text: str) -> list[int]:
        self.texts.append(text)
        return [len(self.texts) - 1]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.texts[i] for i in ids)


@pytest.fixture(scope="module")
def joint(tmp_path_factory):
    from megatron_rl.rewards import RewardPool
    from megatron_rl.rewards.config import RewardConfig

    data = load_prompt_data(joint_config(tmp_path_factory.mktemp("data")))
    with RewardPool(RewardConfig(num_workers=2)) as rewards:
        yield data, rewards


def answer_of(prompt) -> str:
    """A correct response of a math or code prompt (its worked solution)."""
    return prompt.solution


def test_score_groups_routes_rewards_by_domain(joint):
    from megatron_rl.rollout.samples import Sample
    from megatron_rl.trainer.rollout_source import Group
    from megatron_rl.trainer.scoring import score_groups

    data, rewards = joint
    tok = TextTokenizer()
    math_id, code_id = data.train_ids[0], data.train_by_source()[1][1][0]
    groups = []
    for pid in (math_id, code_id):
        right = answer_of(data.get(pid))
        # The other domain's right answer is wrong here: a code solution has no boxed
        # answer, a boxed number is no program.
        other = answer_of(data.get(code_id if pid == math_id else math_id))
        samples = [
            Sample(0, k, [1], tok.ids(text), [0.0], [0], [True], "stop")
            for k, text in enumerate((right, other, right))
        ]
        groups.append(Group(pid, 3, 0, samples))
    config = SimpleNamespace(rollout=SimpleNamespace(episodes=False), reward=rewards.config)
    run = SimpleNamespace(tokenizer=tok, data=data, rewards=rewards, tracker=None, config=config)
    samples, info = score_groups(run, groups, version=0)
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0] * 2
    assert info["reward_mean/math"] == info["reward_mean/code"] == pytest.approx(1 / 3)


class FakePool:
    """Generates, for each prompt, its worked solution for math prompts and a broken
    program for code prompts; counts tokens."""

    def __init__(self, data, tok, ids) -> None:
        self.data, self.tok, self.ids, self.tokens = data, tok, ids, 0

    def generate(self, prompts, seeds, samples_per_prompt, temperature):
        from megatron_rl.rollout.samples import Sample

        out = []
        for index, pid in enumerate(self.ids):
            prompt = self.data.get(pid)
            text = prompt.solution if prompt.kind == "math" else "no program"
            for k in range(samples_per_prompt):
                out.append(Sample(index, k, prompts[index], self.tok.ids(text)))
        self.tokens += len(out)
        return out

    def generated_tokens(self) -> int:
        return self.tokens


def _validation_run(joint, tmp_path):
    """(run, the validation prompt ids): what ``validation.validate`` reads of a run."""
    from megatron_rl.config.sections import ValidationConfig
    from megatron_rl.trainer.compute import ComputeClock
    from megatron_rl.trainer.metrics import MetricsLogger

    data, rewards = joint
    cfg = ValidationConfig(samples_per_prompt=2, num_prompts=5)
    ids = [i for v in data.val_by_domain().values() for i in v[:5]]
    run = SimpleNamespace(
        config=SimpleNamespace(
            validation=cfg, seed=0, rollout=SimpleNamespace(episodes=False), reward=rewards.config
        ),
        data=data,
        tokenizer=TextTokenizer(),
        rewards=rewards,
        clock=ComputeClock(1),
        metrics=MetricsLogger(tmp_path, tensorboard=True),
        forecast=None,
        exporter=None,
        encode=lambda i: [i],
    )
    return run, ids


def test_validation_logs_each_domain_to_metrics_tensorboard_and_the_plot(joint, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.scaling.records import plot_reward_curve, read_records
    from megatron_rl.trainer.validation import validate

    data, _ = joint
    run, ids = _validation_run(joint, tmp_path)
    metrics = run.metrics
    rate = validate(run, FakePool(data, run.tokenizer, ids), step=3)
    metrics.close()
    (record,) = read_records(metrics.path)
    assert record["val_samples"] == 20  # 5 prompts of each domain x 2 samples
    assert record["val_pass_rate/math"] == 1.0 and record["val_pass_rate/code"] == 0.0
    assert record["val_pass_rate"] == rate == 0.5
    assert record["val_reward_errors"] == record["val_reward_crashes"] == 0  # verdicts all
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"val_pass_rate", "val_pass_rate/math", "val_pass_rate/code"} <= set(
        events.Tags()["scalars"]
    )
    png = plot_reward_curve(metrics.path, tmp_path / "reward_curve.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_validation_with_every_engine_restarted_reweighs_and_validates_once(
    joint, tmp_path, monkeypatch
):
    """Every engine died and was restarted mid-validation: ``generate`` raises
    ``WeightsNeeded`` (withdrawing its requests); validation has the weights re-sent (a
    collective of every rank, as in training) and asks again with the same seeds."""
    from megatron_rl.rollout.client import WeightsNeeded
    from megatron_rl.scaling.records import read_records
    from megatron_rl.trainer import handoff, validation

    data, _ = joint
    run, ids = _validation_run(joint, tmp_path)
    events = []

    class RestartedPool(FakePool):
        version = 7

        def generate(self, prompts, seeds, samples_per_prompt, temperature):
            events.append(("generate", list(seeds)))
            if len(events) == 1:
                raise WeightsNeeded("every engine waits for the current weights")
            return super().generate(prompts, seeds, samples_per_prompt, temperature)

    pool = RestartedPool(data, run.tokenizer, ids)
    monkeypatch.setattr(
        handoff,
        "push_weights",
        lambda run_, pool_, reweigh=False: events.append(("reweigh", reweigh)),
    )
    assert validation.validate(run, pool, step=3) == 0.5  # math right, code wrong (as above)
    run.metrics.close()
    seeds = events[0][1]
    assert events == [("generate", seeds), ("reweigh", True), ("generate", seeds)]
    (record,) = read_records(run.metrics.path)
    assert record["val_samples"] == 20 and record["step"] == 3


def test_plot_keys_add_one_line_per_domain():
    from megatron_rl.scaling.records import _with_domains

    records = [
        {"step": 0, "val_pass_rate": 0.1, "val_pass_rate/math": 0.2, "val_pass_rate/code": 0.0},
        {"step": 1, "reward_mean": 0.0, "reward_mean/code": -1.0, "loss": 1.0},
    ]
    assert _with_domains(("reward_mean", "val_pass_rate"), records) == (
        "reward_mean",
        "reward_mean/code",
        "val_pass_rate",
        "val_pass_rate/math",
        "val_pass_rate/code",
    )
