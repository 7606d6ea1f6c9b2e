"""Typed configuration of the compute-curve fit and of a run's live forecast (recipe section
``forecast``); no torch, no numpy at import."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.errors import ConfigError

AUTO = "auto"

# The paper's grid (docs/paper.md section 1): A in {0.450, 0.455, ..., 0.800}, C_mid over 100
# linearly spaced values in [100, 40000] GPU-hours, points before 1.5k GPU-hours excluded.
PAPER_A_RANGE = (0.450, 0.800)
PAPER_A_STEP = 0.005
PAPER_C_MID_RANGE = (100.0, 40000.0)
PAPER_C_MID_NUM = 100
PAPER_MIN_X = 1500.0
# Three independent ScaleRL runs gave A within +-0.015; the paper compares with +-0.02.
PAPER_A_TOLERANCE = 0.02

C_MID_SPACINGS = ("linear", "log")
GRIDS = ("paper", "auto")  # ForecastConfig.grid


@dataclass
class FitConfig:
    """Options of `fit_curve` / `compare_runs` (defaults reproduce the paper's procedure).

    Ranges are ``(low, high)`` tuples or the string ``"auto"``:

    - ``a_range="auto"``: ``[R0 + 0.5 * gain, max_y + gain]`` where ``gain = max_y - R0`` over
      the fitted points, clipped to ``[0, 1]`` when every y lies in ``[0, 1]`` (pass rates),
      with 71 values (as many as the paper's grid); ``a_step`` is then ignored.
    - ``c_mid_range="auto"``: ``[smallest positive x of the run / 4, 4 * largest fitted x]``,
      ``c_mid_num`` values, log-spaced (runs at any compute scale, e.g. 1e-3 GPU-hours).

    B is searched on ``b_range`` (the paper leaves B unbounded, starting curve_fit at 1); the
    joint refinement stays inside the A, B and C_mid ranges, and a fit that ends on an edge
    is flagged (``CurveFit.at_bound``) so that the range can be widened.
    """

    x_field: str = "gpu_hours"
    y_field: str = "val_pass_rate"
    # Points with x < min_x are not fitted (the paper's early, near-linear phase).
    min_x: float = PAPER_MIN_X
    # Fit only points with x <= fit_until (None: all); the rest are held out.
    fit_until: float | None = None
    # Pass rate at zero compute; None: the y of the record with the smallest x.
    r0: float | None = None
    # Fix the asymptote A instead of fitting it.
    fix_a: float | None = None
    a_range: tuple[float, float] | str = PAPER_A_RANGE
    a_step: float = PAPER_A_STEP
    c_mid_range: tuple[float, float] | str = PAPER_C_MID_RANGE
    c_mid_num: int = PAPER_C_MID_NUM
    c_mid_spacing: str = "linear"
    # B is searched on this log-spaced range (b_num values, then golden-section refinement).
    b_range: tuple[float, float] = (0.05, 20.0)
    b_num: int = 64
    # Refine A, B, C_mid jointly (least squares within the grid box) after the grid search.
    refine: bool = True
    min_points: int = 5
    # Bootstrap over points: number of resamples (0: none), interval level, seed.
    bootstrap: int = 0
    ci: float = 0.95
    seed: int = 0
    # Runs whose A lie within this spread are refitted with A fixed at their mean.
    a_tolerance: float = PAPER_A_TOLERANCE

    def validate(self) -> FitConfig:
        """Raise ``ValueError`` naming the first invalid field; return self."""
        for name in ("x_field", "y_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty field name")
        _check_finite("min_x", self.min_x)
        for name in ("fit_until", "r0", "fix_a"):
            if getattr(self, name) is not None:
                _check_finite(name, getattr(self, name))
        if self.fit_until is not None and self.fit_until < self.min_x:
            raise ValueError(f"fit_until ({self.fit_until}) must be >= min_x ({self.min_x})")
        _check_range("a_range", self.a_range, positive=False)
        _check_range("c_mid_range", self.c_mid_range, positive=True)
        _check_range("b_range", self.b_range, positive=True)
        if not self.a_step > 0:
            raise ValueError(f"a_step must be > 0, got {self.a_step}")
        if self.c_mid_num < 1:
            raise ValueError(f"c_mid_num must be >= 1, got {self.c_mid_num}")
        if self.c_mid_spacing not in C_MID_SPACINGS:
            raise ValueError(
                f"c_mid_spacing must be one of {C_MID_SPACINGS}, got {self.c_mid_spacing!r}"
            )
        if self.b_num < 3:
            raise ValueError(f"b_num must be >= 3, got {self.b_num}")
        if self.min_points < 4:
            raise ValueError(f"min_points must be >= 4, got {self.min_points}")
        if self.bootstrap < 0:
            raise ValueError(f"bootstrap must be >= 0, got {self.bootstrap}")
        if not 0 < self.ci < 1:
            raise ValueError(f"ci must be in (0, 1), got {self.ci}")
        if not self.a_tolerance >= 0:
            raise ValueError(f"a_tolerance must be >= 0, got {self.a_tolerance}")
        return self


@dataclass
class ForecastConfig:
    """The live forecast of a run (recipe section ``forecast``).

    Attributes:
        enabled: forecast after every validation (none without validation).
        min_gpu_hours: fit only points with ``gpu_hours >= this`` (the paper: 1.5k, to skip
            the early near-linear phase). CPU-scale runs use 0.
        budget_gpu_hours: the compute at which to predict the pass rate; null: the run's
            ``training.max_gpu_hours``, or, without one, the training GPU-hours the run will
            have spent at ``training.max_steps`` at its rate so far.
        bootstrap: bootstrap resamples for the intervals (0: no intervals).
        ci: interval level.
        grid: ``paper``: the paper's grid (A in 0.450..0.800, C_mid in 100..40,000
            GPU-hours); ``auto``: ranges from the data (runs at any compute scale).
        min_points: fewest fitted points before the first forecast.
        seed: bootstrap seed.
    """

    enabled: bool = True
    min_gpu_hours: float = PAPER_MIN_X
    budget_gpu_hours: float | None = None
    bootstrap: int = 100
    ci: float = 0.95
    grid: Literal["paper", "auto"] = "paper"
    min_points: int = 5
    seed: int = 0

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        if not (_is_number(self.min_gpu_hours) and self.min_gpu_hours >= 0):
            raise ConfigError("min_gpu_hours", f"must be a number >= 0, got {self.min_gpu_hours!r}")
        if self.budget_gpu_hours is not None and not (
            _is_number(self.budget_gpu_hours) and self.budget_gpu_hours > 0
        ):
            raise ConfigError("budget_gpu_hours", f"must be > 0, got {self.budget_gpu_hours!r}")
        if isinstance(self.bootstrap, bool) or not isinstance(self.bootstrap, int):
            raise ConfigError("bootstrap", f"must be an int >= 0, got {self.bootstrap!r}")
        if self.bootstrap < 0:
            raise ConfigError("bootstrap", f"must be an int >= 0, got {self.bootstrap!r}")
        if self.grid not in GRIDS:
            raise ConfigError("grid", f"must be one of {GRIDS}, got {self.grid!r}")
        if not (_is_number(self.ci) and 0 < self.ci < 1):
            raise ConfigError("ci", f"must be in (0, 1), got {self.ci!r}")
        if isinstance(self.min_points, bool) or not isinstance(self.min_points, int):
            raise ConfigError("min_points", f"must be an int >= 4, got {self.min_points!r}")
        if self.min_points < 4:  # FitConfig's floor: three parameters and a residual
            raise ConfigError("min_points", f"must be an int >= 4, got {self.min_points!r}")
        self.fit_config().validate()

    def fit_config(self) -> FitConfig:
        """The FitConfig of the forecast's fits (the paper's protocol, its grid or 'auto')."""
        grid = {} if self.grid == "paper" else {"a_range": AUTO, "c_mid_range": AUTO}
        return FitConfig(
            min_x=float(self.min_gpu_hours),
            min_points=self.min_points,
            bootstrap=self.bootstrap,
            ci=self.ci,
            seed=self.seed,
            **grid,
        )


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_range(name: str, value: tuple[float, float] | str, positive: bool) -> None:
    if isinstance(value, str):
        if value != AUTO or name == "b_range":
            raise ValueError(f"{name} must be (low, high) or {AUTO!r}, got {value!r}")
        return
    if len(value) != 2 or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"{name} must be (low, high), got {value!r}")
    low, high = value
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"{name} must satisfy low <= high (finite), got {value!r}")
    if positive and low <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
