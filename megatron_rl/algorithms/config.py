"""Recipe-facing configuration of the RL algorithm (imports no torch).

Defaults are the ScaleRL recipe (docs/paper.md section 2): CISPO with eps_max 4, prompt-level
loss aggregation, batch-level advantage normalisation, zero-variance filtering and
No-Positive-Resampling at pass rate 0.9; forced interruptions instead of a length penalty.
Dynamic sampling (refilling the batch, ``data.dynamic_sampling``) is done by the trainer's rollout
source, not configured here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from megatron_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)

# Names of the registries in megatron_rl.algorithms (kept here so that the config schema
# imports no torch; tests check that they match the registries).
LOSS_NAMES: tuple[str, ...] = ("cispo", "ppo_clip", "gspo", "reinforce")
AGGREGATION_NAMES: tuple[str, ...] = ("prompt", "sample", "token")
NORMALIZATION_NAMES: tuple[str, ...] = ("batch", "group", "none")
NPR_HISTORY_NAMES: tuple[str, ...] = ("cumulative", "latest")
LENGTH_PENALTY_ON: tuple[str, ...] = ("correct", "all")
# Train-inference mismatch corrections and the level their ratio is taken at
# (megatron_rl.algorithms.mismatch).
MISMATCH_NAMES: tuple[str, ...] = ("none", "tis", "mis", "icepop")
MISMATCH_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
# Where the trainer's side of the mismatch (and the loss's "old" policy with a correction)
# comes from: the update's own forward, or a recompute at the generator's weights.
MISMATCH_REFERENCES: tuple[str, ...] = ("update", "recompute")
# Band [low, high] when the recipe leaves it unset: TIS's cap C = 2 (verl's
# rollout_is_threshold, slime's --tis-clip); MIS's lower bound 1 / upper (verl); IcePop's
# [0.5, 2] (the IcePop band, slime's icepop_function). TIS has no lower bound.
DEFAULT_MISMATCH_BAND: dict[str, tuple[float, float]] = {
    "tis": (0.0, 2.0),
    "mis": (0.5, 2.0),
    "icepop": (0.5, 2.0),
}

# Aggregation when the recipe leaves it unset, by loss (others: "prompt", ScaleRL's). GSPO's
# objective is a mean over sequences of a sequence-level term (arXiv 2507.18071, eq. 5): the
# same value for every token of a sample. A prompt or token average would weigh each sample
# by its length, undoing the 1/|y| normalisation of its ratio; a sample average keeps it (TRL
# reproduces the paper with its per-sequence mean, loss_type "grpo").
DEFAULT_AGGREGATION: dict[str, str] = {"gspo": "sample"}

# Default clip ranges when the recipe leaves eps_low / eps_high unset.
# PPO-clip: GRPO's symmetric 0.2 / 0.2. GSPO: the sequence-level scale of the GSPO paper.
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "ppo_clip": (0.2, 0.2),
    "gspo": (3e-3, 4e-3),
}


@dataclass
class AlgorithmConfig:
    """Loss, aggregation, advantages and filters of one RL recipe.

    Attributes:
        loss: policy loss, one of LOSS_NAMES.
        eps_max: CISPO truncation of the importance ratio (the paper found 4, 5, 8 equal).
        eps_low: lower clip (ratio >= 1 - eps_low) for ppo_clip / gspo; None = loss default.
        eps_high: upper clip (ratio <= 1 + eps_high) for ppo_clip / gspo; None = loss default.
        aggregation: how token objectives are averaged, one of AGGREGATION_NAMES; unset
            (None): the loss's own, ``sample`` for gspo (see DEFAULT_AGGREGATION), else
            ``prompt`` (ScaleRL). Resolved at construction: the loaded config holds a name.
        advantage_normalization: one of NORMALIZATION_NAMES.
        zero_variance_filter: groups whose rewards are all equal get no loss and no share of
            the loss normalisers (no refill). With ``data.dynamic_sampling`` such groups are
            replaced before they reach a batch; they reach one only past its cap.
        npr_threshold: No-Positive-Resampling pass-rate threshold; None disables it.
        npr_history: which pass rate is compared with the threshold: "cumulative" (all
            samples of the prompt over all epochs) or "latest" (the last observed group).
        length_penalty: add clip((l_max - len) / l_cache - 1, -1, 0) to correct samples.
        length_penalty_l_max: L_max of the length penalty, in tokens (paper: 14k).
        length_penalty_l_cache: L_cache of the length penalty, in tokens (paper: 2k).
        length_penalty_on: the samples whose reward gets the penalty: "correct" (ScaleRL's
            alternative to interruptions, docs/paper.md section 2) or "all" (DAPO's soft overlong
            punishment, arXiv 2503.14476 section 3.4, added to every response's reward).
        routing_replay: MoE models: the policy forward routes every token to the experts the
            generator routed it to (R3; ``megatron_rl.trainer.routing_replay``). The engines
            then return routed experts and run without prefix caching. Off in the paper's
            recipes (recipes/scalerl_scout_routing_replay.yaml turns it on).
        mismatch: train-inference mismatch correction, one of MISMATCH_NAMES: "none" (the
            paper's recipes: the loss's ratio is trainer / generator), "tis" (truncated
            importance weight min(r, mismatch_high)), "mis" (weight r inside
            [mismatch_low, mismatch_high], the token or sample masked outside), "icepop"
            (token-level mis, band [0.5, 2]). Any correction takes the loss's ratio against
            the trainer's own log-probs and weighs its objective by the correction of
            r = trainer / generator (``megatron_rl.algorithms.mismatch``).
        mismatch_level: where r is taken, one of MISMATCH_LEVELS: per token, per sample
            (product of the token ratios) or per sample's geometric mean; icepop: token.
        mismatch_low: lower end of the mis / icepop band, in [0, 1]; None: 0.5. Not for tis.
        mismatch_high: TIS's cap C, or the upper end of the band, >= 1; None: 2.
        mismatch_reference: the trainer's log-probs the correction compares with the
            generator's, one of MISMATCH_REFERENCES: "update" (the update's own forward, no
            extra forward) or "recompute" (off_policy.mode ppo only: pi_old recomputed at the
            round's generating weights by one extra forward per batch; the loss's ratio
            pi_theta / pi_old, the correction of pi_old / generator). With "update"
            (AReaL's proximal policy, detached) the loss's ratio is 1 in value and
            r = trainer / generator carries the staleness too. With "recompute" (verl's three
            policies), before the first update of a PPO-off-policy-k round one no-grad
            forward over the round's k batches at the weights that generated them stores
            pi_old; each update then keeps the staleness inside the loss's clip and the
            correction sees the mismatch alone (with mismatch none: no weight, verl's
            recomputed old log-probs). PipelineRL is refused: its samples span versions
            whose weights are gone. Its cost: the ``recompute_seconds`` metric;
            tools/bench_train_step.py --recompute.
    """

    loss: str = "cispo"
    eps_max: float = 4.0
    eps_low: float | None = None
    eps_high: float | None = None
    aggregation: str | None = None
    advantage_normalization: str = "batch"
    zero_variance_filter: bool = True
    npr_threshold: float | None = 0.9
    npr_history: str = "cumulative"
    length_penalty: bool = False
    length_penalty_l_max: int = 14336
    length_penalty_l_cache: int = 2048
    length_penalty_on: str = "correct"
    routing_replay: bool = False
    mismatch: str = "none"
    mismatch_level: str = "token"
    mismatch_low: float | None = None
    mismatch_high: float | None = None
    mismatch_reference: str = "update"

    def __post_init__(self) -> None:
        if self.aggregation is None:
            self.aggregation = DEFAULT_AGGREGATION.get(self.loss, "prompt")

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        _check_choice("loss", self.loss, LOSS_NAMES)
        _check_choice("aggregation", self.aggregation, AGGREGATION_NAMES)
        if self.loss == "gspo" and self.aggregation != "sample":
            logger.warning(
                "algorithm.loss gspo with algorithm.aggregation %s weighs each sample by its "
                "length, undoing GSPO's 1/|y| length normalisation (its objective is a mean "
                "over sequences); leave aggregation unset or set it to sample",
                self.aggregation,
            )
        _check_choice("advantage_normalization", self.advantage_normalization, NORMALIZATION_NAMES)
        _check_choice("npr_history", self.npr_history, NPR_HISTORY_NAMES)
        _check_choice("length_penalty_on", self.length_penalty_on, LENGTH_PENALTY_ON)
        if not _finite(self.eps_max) or self.eps_max <= 0:
            raise ConfigError("eps_max", f"must be a finite number > 0, got {self.eps_max!r}")
        if self.eps_low is not None and (not _finite(self.eps_low) or not 0 <= self.eps_low < 1):
            raise ConfigError("eps_low", f"must be in [0, 1), got {self.eps_low!r}")
        if self.eps_high is not None and (not _finite(self.eps_high) or self.eps_high < 0):
            raise ConfigError("eps_high", f"must be a finite number >= 0, got {self.eps_high!r}")
        if self.npr_threshold is not None and (
            not _finite(self.npr_threshold) or not 0 < self.npr_threshold <= 1
        ):
            raise ConfigError(
                "npr_threshold", f"must be in (0, 1] or None, got {self.npr_threshold!r}"
            )
        for name in ("zero_variance_filter", "length_penalty", "routing_replay"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.length_penalty_l_cache) or self.length_penalty_l_cache <= 0:
            raise ConfigError(
                "length_penalty_l_cache", f"must be an int > 0, got {self.length_penalty_l_cache!r}"
            )
        if (
            not _is_int(self.length_penalty_l_max)
            or self.length_penalty_l_max < self.length_penalty_l_cache
        ):
            raise ConfigError(
                "length_penalty_l_max",
                "must be an int >= algorithm.length_penalty_l_cache, got "
                f"{self.length_penalty_l_max!r}",
            )
        self._validate_mismatch()

    def _validate_mismatch(self) -> None:
        _check_choice("mismatch", self.mismatch, MISMATCH_NAMES)
        _check_choice("mismatch_level", self.mismatch_level, MISMATCH_LEVELS)
        _check_choice("mismatch_reference", self.mismatch_reference, MISMATCH_REFERENCES)
        if self.mismatch == "icepop" and self.mismatch_level != "token":
            raise ConfigError(
                "mismatch_level",
                f"icepop masks tokens: must be token with algorithm.mismatch icepop, got "
                f"{self.mismatch_level!r} (a sample-level band: mismatch mis)",
            )
        high, low = self.mismatch_high, self.mismatch_low
        if high is not None and (not _finite(high) or high < 1):
            raise ConfigError(
                "mismatch_high",
                f"must be a finite number >= 1 (a cap below 1 shrinks even exact tokens), "
                f"got {high!r}",
            )
        if low is not None:
            if self.mismatch == "tis":
                raise ConfigError(
                    "mismatch_low",
                    "TIS truncates from above only: leave it unset with algorithm.mismatch "
                    "tis (a band that masks: mismatch mis)",
                )
            if not _finite(low) or not 0 <= low <= 1:
                raise ConfigError("mismatch_low", f"must be in [0, 1], got {low!r}")
        if self.mismatch == "none" and (low is not None or high is not None):
            logger.warning(
                "algorithm.mismatch_low / mismatch_high are set but algorithm.mismatch is none: "
                "no correction is applied"
            )

    @property
    def recompute(self) -> bool:
        """Whether the trainer recomputes pi_old at the generator's weights
        (``mismatch_reference: recompute``)."""
        return self.mismatch_reference == "recompute"

    def mismatch_params(self) -> dict[str, str | float]:
        """Keyword parameters of ``mismatch.MismatchCorrection`` for this recipe (the band's
        unset ends filled with ``DEFAULT_MISMATCH_BAND``)."""
        low, high = DEFAULT_MISMATCH_BAND.get(self.mismatch, DEFAULT_MISMATCH_BAND["mis"])
        return {
            "mode": self.mismatch,
            "level": self.mismatch_level,
            "low": low if self.mismatch_low is None else float(self.mismatch_low),
            "high": high if self.mismatch_high is None else float(self.mismatch_high),
        }

    def loss_params(self) -> dict[str, float]:
        """Keyword parameters of the selected loss, for ``policy_loss(kind, ..., **params)``."""
        if self.loss == "cispo":
            return {"eps_max": self.eps_max}
        if self.loss in DEFAULT_CLIP:
            low, high = DEFAULT_CLIP[self.loss]
            return {
                "eps_low": low if self.eps_low is None else self.eps_low,
                "eps_high": high if self.eps_high is None else self.eps_high,
            }
        return {}


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, f"must be one of {list(choices)}, got {value!r}")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
