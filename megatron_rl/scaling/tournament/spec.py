"""A tournament's spec (``megatron-rl tournament SPEC.yaml``) and its plan. No torch.

::

    name: tiny_cpu
    base: ../tiny_cpu.yaml          # the recipe every variant starts from (relative to SPEC)
    overrides: [validation.every_steps=5]   # applied to every variant
    budget_gpu_hours: 0.004         # training compute per variant (its training.max_gpu_hours)
    target_gpu_hours: 0.02          # the compute to predict each variant's pass rate at
    executor: local                 # local (processes here) or slurm (`megatron-rl launch`)
    parallel: 1                     # local: variants at a time
    fit: {min_gpu_hours: 0, grid: auto, bootstrap: 50}   # the live forecast's fit settings
    early_stop: {enabled: true, points_past_c_mid: 3}
    rank_by: target                 # R(target_gpu_hours), or asymptote (A; the paper's reading)
    variants:                       # name -> overrides (dotted.key=value, as on the CLI)
      scalerl: []
      low_lr: [optimizer.lr=1.0e-5]

Every variant starts from one shared initial checkpoint: the base recipe's ``model.hf_path``
(an SFT'd checkpoint), or, when the base recipe warm-starts (``warm_start.steps`` > 0: the
tiny CPU recipes), one warm start made once for the whole tournament. Variants may therefore
not override ``model.hf_path``, ``model.preset``, ``warm_start.*``, the data or the budget
(the common ``overrides`` may: they apply to all).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.errors import ConfigError
from megatron_rl.scaling.config import PAPER_A_TOLERANCE, ForecastConfig

EXECUTORS = ("local", "slurm")
RANK_BY = ("target", "asymptote")  # judge.py: R(target) with its band, or A
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Keys a variant may not change: the shared start, the data, the budget and the run's place.
FROZEN_PREFIXES = ("model.hf_path", "model.preset", "warm_start.", "data.", "training.max_gpu")
FROZEN_PREFIXES += ("name",)


@dataclass
class EarlyStopConfig:
    """``early_stop``: stop a variant whose asymptote is confidently below the leader's.

    Attributes:
        enabled: apply the rule while variants run.
        points_past_c_mid: fitted validations past the upper end of C_mid's interval that the
            variant and the leader each need before the rule compares them. Before its
            midpoint a curve is near-linear and A is an extrapolation: its bootstrap
            interval then says more about the grid than about the run.
        a_margin: the gap required between the two: the upper end of the variant's A
            must lie this far below the lower end of the leader's. A bootstrap over one
            run's points does not see the spread of A between seeds (the paper: three
            ScaleRL runs within +-0.015, compared with a 0.02 tolerance).
    """

    enabled: bool = True
    points_past_c_mid: int = 3
    a_margin: float = PAPER_A_TOLERANCE

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("enabled", f"must be true or false, got {self.enabled!r}")
        n = self.points_past_c_mid
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("points_past_c_mid", f"must be an int >= 1, got {n!r}")
        m = self.a_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ConfigError("a_margin", f"must be a number in [0, 1), got {m!r}")


@dataclass
class TournamentSpec:
    """A parsed, validated spec (module docstring); ``path``: the spec file."""

    name: str
    base: Path
    variants: dict[str, list[str]]
    budget_gpu_hours: float
    target_gpu_hours: float
    overrides: list[str] = field(default_factory=list)
    executor: str = "local"
    parallel: int = 1
    fit: ForecastConfig = field(default_factory=ForecastConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    rank_by: str = "target"
    path: Path | None = None

    def variant_overrides(self, name: str) -> list[str]:
        """The overrides of variant ``name`` (common ones first, then its own, then the
        budget): what its run gets on the command line."""
        budget = f"training.max_gpu_hours={self.budget_gpu_hours!r}"
        return [*self.overrides, *self.variants[name], budget]


_KEYS = {f.name for f in fields(TournamentSpec)} - {"path"}


def load_spec(path: str | Path) -> TournamentSpec:
    """Read and validate a spec; every variant's recipe is loaded (and validated) too.
    Raises ConfigError naming the spec file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tournament spec not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not YAML ({err})") from None
    try:
        spec = spec_from_dict(data, path.parent)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    spec.path = path
    return spec


def spec_from_dict(data: Any, root: Path) -> TournamentSpec:
    """The spec of a parsed YAML mapping (``root``: the directory ``base`` is relative to)."""
    if not isinstance(data, dict):
        raise ConfigError("", "a tournament spec is a mapping")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(unknown[0], f"unknown key; known: {', '.join(sorted(_KEYS))}")
    for key in ("name", "base", "variants", "budget_gpu_hours", "target_gpu_hours"):
        if key not in data:
            raise ConfigError(key, "missing")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError("name", f"must be a name of [A-Za-z0-9_.-], got {name!r}")
    base = root / str(data["base"])
    if not base.is_file():
        raise ConfigError("base", f"recipe not found: {base}")
    spec = TournamentSpec(
        name=name,
        base=base.resolve(),
        variants=_variants(data["variants"]),
        budget_gpu_hours=_positive(data, "budget_gpu_hours"),
        target_gpu_hours=_positive(data, "target_gpu_hours"),
        overrides=_overrides(data.get("overrides", []), "overrides", frozen=()),
        executor=data.get("executor", "local"),
        parallel=data.get("parallel", 1),
        fit=_section(ForecastConfig, data.get("fit", {}), "fit"),
        early_stop=_section(EarlyStopConfig, data.get("early_stop", {}), "early_stop"),
        rank_by=data.get("rank_by", "target"),
    )
    if spec.rank_by not in RANK_BY:
        raise ConfigError("rank_by", f"must be one of {RANK_BY}, got {spec.rank_by!r}")
    if spec.executor not in EXECUTORS:
        raise ConfigError("executor", f"must be one of {EXECUTORS}, got {spec.executor!r}")
    if isinstance(spec.parallel, bool) or not isinstance(spec.parallel, int) or spec.parallel < 1:
        raise ConfigError("parallel", f"must be an int >= 1, got {spec.parallel!r}")
    if spec.target_gpu_hours < spec.budget_gpu_hours:
        raise ConfigError(
            "target_gpu_hours",
            f"{spec.target_gpu_hours:g} is below the budget per variant "
            f"({spec.budget_gpu_hours:g}): predict beyond what a variant spends",
        )
    for variant in spec.variants:
        load_variant(spec, variant)  # a bad override fails now, naming the variant
    return spec


def load_variant(spec: TournamentSpec, variant: str, extra: list[str] | None = None):
    """The validated RunConfig of ``variant`` (plus ``extra`` overrides)."""
    from megatron_rl.config import load_run_config

    overrides = [*spec.variant_overrides(variant), *(extra or [])]
    try:
        return load_run_config(spec.base, overrides, check_model=False)
    except ConfigError as err:
        raise ConfigError(f"variants.{variant}", str(err)) from None


def _variants(value: Any) -> dict[str, list[str]]:
    if not isinstance(value, dict) or not value:
        raise ConfigError("variants", "must map each variant's name to its overrides")
    out = {}
    for name, overrides in value.items():
        if not isinstance(name, str) or not _NAME.match(name) or name.startswith("_"):
            raise ConfigError("variants", f"bad variant name {name!r} (a name of [A-Za-z0-9_.-])")
        out[name] = _overrides(overrides or [], f"variants.{name}")
    return out


def _overrides(value: Any, key: str, frozen: tuple[str, ...] = FROZEN_PREFIXES) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"must be a list of dotted.key=value overrides, got {value!r}")
    for item in value:
        dotted, sep, _ = item.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(key, f"{item!r}: expected dotted.key=value")
        if frozen and dotted.strip().startswith(frozen):
            raise ConfigError(
                key,
                f"{item!r}: a variant may not change {dotted.strip()} (every variant starts "
                "from the same checkpoint and data with the same budget)",
            )
    return list(value)


def _positive(data: dict, key: str) -> float:
    value = data[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):
        raise ConfigError(key, f"must be a number > 0, got {value!r}")
    return float(value)


def _section(cls: type, value: Any, key: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a mapping, got {value!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key; known: {', '.join(sorted(known))}")
    section = cls(**value)
    try:
        section.validate()
    except ConfigError as err:
        raise err.within(key) from None
    return section


@dataclass
class VariantPlan:
    """What one variant will cost: ``gpus`` of its job, the training budget, and the job's
    ceiling (``gpus`` x the Slurm time limit) per job."""

    name: str
    gpus: int
    budget_gpu_hours: float
    job_hours: float

    @property
    def wall_hours(self) -> float:
        """Hours of the allocation to spend the budget (training compute only: validation,
        checkpoints and start-up come on top)."""
        return self.budget_gpu_hours / self.gpus

    @property
    def jobs(self) -> int:
        """Jobs of the time limit the budget needs at least (a requeue resumes)."""
        return max(1, math.ceil(self.wall_hours / self.job_hours)) if self.job_hours else 1


def plan(spec: TournamentSpec) -> list[VariantPlan]:
    """GPU-hours per variant (the planner's numbers printed by ``--dry-run``)."""
    out = []
    for name in spec.variants:
        cluster = load_variant(spec, name).cluster
        gpus = cluster.nodes * cluster.gpus_per_node
        out.append(VariantPlan(name, gpus, spec.budget_gpu_hours, _hours(cluster.time)))
    return out


def format_plan(spec: TournamentSpec, plans: list[VariantPlan]) -> str:
    """The plan as a table, with the tournament's total."""
    rows = [["variant", "GPUs", "training GPU-h", "wall h (at least)", "jobs of the limit"]]
    for p in plans:
        rows.append(
            [p.name, str(p.gpus), f"{p.budget_gpu_hours:,.6g}", f"{p.wall_hours:.3g}", str(p.jobs)]
        )
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = [f"tournament {spec.name}: {len(plans)} variants of {spec.base.name}"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    total = sum(p.budget_gpu_hours for p in plans)
    lines.append(
        f"  total: {total:,.6g} training GPU-hours at most (early stopping spends less); "
        f"predicting each variant at {spec.target_gpu_hours:,.6g}"
    )
    return "\n".join(lines)


def _hours(limit: str) -> float:
    """Slurm's time limit (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]) in hours."""
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = parts
    return int(days or 0) * 24 + h + m / 60 + s / 3600
