"""Policy losses by name; a new loss is one ``PolicyLoss`` subclass in one file, added here
and to ``config.LOSS_NAMES``."""

from megatron_rl.algorithms.config import LOSS_NAMES
from megatron_rl.algorithms.losses.base import LossTerms, PolicyLoss
from megatron_rl.algorithms.losses.cispo import CISPOLoss
from megatron_rl.algorithms.losses.gspo import GSPOLoss
from megatron_rl.algorithms.losses.ppo_clip import PPOClipLoss
from megatron_rl.algorithms.losses.reinforce import ReinforceLoss

# policy loss by name (recipes select with `loss: <name>`)
LOSSES: dict[str, type[PolicyLoss]] = {
    "cispo": CISPOLoss,
    "ppo_clip": PPOClipLoss,
    "gspo": GSPOLoss,
    "reinforce": ReinforceLoss,
}
assert tuple(LOSSES) == LOSS_NAMES

__all__ = [
    "LOSSES",
    "CISPOLoss",
    "GSPOLoss",
    "LossTerms",
    "PPOClipLoss",
    "PolicyLoss",
    "ReinforceLoss",
]
