"""The weight of megatron-core's MoE router losses (load-balancing aux loss, z-loss) in a
policy update.

Our losses are summed over micro-batches and data-parallel ranks, already normalised
(``trainer.optim``: megatron's ``calculate_per_token_loss`` mode, without its division by
the token count). megatron-core's routers attach each micro-batch's aux and z losses to the
backward through ``MoEAuxLossAutoScaler``, whose scale the schedule sets to 1 in that mode:
left as is, every micro-batch of every rank would add its router losses in full, and a
coefficient would weigh (micro-batches x DP ranks) times more than it says.
:func:`scale_router_losses` sets the scale to ``1 / (micro-batches x DP ranks)``: the step's
router loss is the mean of the micro-batches' losses times its coefficient, as megatron-core
weighs it in its default mode (``1 / micro-batches``, then gradients averaged over DP).

The routers take their mode from the config when they are built, before ``wrap_model`` sets
per-token mode: they attach the plain micro-batch loss (not times its token count). The
schedule resets the scale in every forward step, after our code; the scale is read in the
backward. So it is set at the start of each micro-batch's backward, by an identity autograd
function on the stage's output (the first node that backward reaches).
"""

from __future__ import annotations

import torch


def has_router_losses(config) -> bool:
    """Whether megatron-core's routers add an aux or z loss under ``config``."""
    if not config.num_moe_experts:
        return False
    coeffs = config.moe_aux_loss_coeff
    coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs]
    return any(c > 0 for c in coeffs) or config.moe_z_loss_coeff is not None


def check_router_loss_mode(model: torch.nn.Module) -> None:
    """Raise if a router multiplies its losses by its token count (built in per-token mode):
    the scale of :func:`scale_router_losses` assumes plain micro-batch losses."""
    from megatron.core.transformer.moe.router import Router

    if any(m.calculate_per_token_loss for m in model.modules() if isinstance(m, Router)):
        raise RuntimeError(
            "MoE routers were built with calculate_per_token_loss: build the model before "
            "trainer.optim.wrap_model sets it (router losses would weigh n tokens times more)"
        )


class _SetRouterLossScale(torch.autograd.Function):
    """Identity; its backward sets megatron's aux-loss scale before the MoE layers' backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # A new tensor: megatron keeps the first one it is given and copies into it later.
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([ctx.scale], device=grad.device))
        return grad, None


def scale_router_losses(output: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """``output`` (a pipeline stage's forward output), such that the router losses of the
    layers before it weigh ``1 / micro_batches`` (all data-parallel ranks' together)."""
    return _SetRouterLossScale.apply(output, 1.0 / micro_batches)
