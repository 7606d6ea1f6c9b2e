"""Forward passes that return what RL needs: per-token log-probs (vocab-parallel) or logits."""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel


def forward_logits(
    model,
    tokens: torch.Tensor,
    padding: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's vocab shard of the logits ``[b, s, V/tp]`` for ``tokens [b, s]`` (on an
    earlier pipeline stage: the hidden states it passes on).

    Positions are 0..s-1 and attention is causal (right padding needs no mask).
    ``padding [b, s]`` bool: the right-padding positions (True), which MoE routers leave out
    of their auxiliary / z losses (megatron-core's ``padding_mask``; experts still compute
    them). True means padding, as megatron-core 0.16.1's code reads it (``~padding_mask``
    are the valid tokens in router.py and moe_utils.py; some of its docstrings say the
    opposite).

    ``cu_seqlens [n + 1]`` (int32): ``tokens [1, T]`` is a packed micro-batch, sequences back to
    back starting at ``cu_seqlens[:-1]`` (``trainer.packing``): it runs in megatron's THD layout
    (``PackedSeqParams``), positions restarting at 0 in each sequence, no attention across them.
    """
    b, s = tokens.shape
    # the sequence bounds on the host: the forward's one read of cu_seqlens (a device sync
    # where it is on the GPU); the positions, the attention and the RoPE all take them from here
    bounds = None if cu_seqlens is None else cu_seqlens.tolist()
    if bounds is not None and (b != 1 or bounds[-1] != s):
        raise ValueError(
            f"a packed micro-batch is [1, T] with cu_seqlens ending at T: got tokens "
            f"{tuple(tokens.shape)} and cu_seqlens ending at {bounds[-1]}"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sequence_parallel = model.config.sequence_parallel and tp > 1
    if sequence_parallel and s % tp:
        # Sequence parallelism splits the sequence over TP ranks: right-pad to a multiple
        # (causal attention: the padding changes nothing before it) and cut the logits back.
        tokens = torch.nn.functional.pad(tokens, (0, tp - s % tp))
        if padding is not None:
            padding = torch.nn.functional.pad(padding, (0, tp - s % tp), value=True)
        if cu_seqlens is not None:  # the padding: a sequence of its own, attending to itself
            end = torch.tensor([tokens.shape[1]], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            cu_seqlens = torch.cat([cu_seqlens, end])
            bounds = [*bounds, tokens.shape[1]]
    extra = {}
    if cu_seqlens is None:
        position_ids = (
            torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand(b, -1)
        )
    else:
        cu_seqlens = cu_seqlens.to(device=tokens.device, dtype=torch.int32)
        position_ids = packed_positions(cu_seqlens, bounds[-1]).unsqueeze(0)
        extra["packed_seq_params"] = _packed_seq_params(cu_seqlens, bounds)
    if padding is not None:
        if sequence_parallel and not parallel_state.is_pipeline_first_stage():
            # megatron-core 0.16.1: GPTModel._preprocess cuts padding_mask to this rank's
            # sequence-parallel chunk on the first pipeline stage only; a later stage would
            # hand the routers the whole [b, s] mask for its [s / tp, b] tokens.
            chunk = padding.shape[1] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            padding = padding[:, rank * chunk : (rank + 1) * chunk]
        extra["padding_mask"] = padding.to(tokens.device)
    output = model(tokens, position_ids, None, **extra)
    if parallel_state.is_pipeline_last_stage():
        return output[:, :s]
    return output  # an earlier pipeline stage's hidden states, for the next stage


def packed_positions(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` each token's position in its own sequence (0 at every start). ``total``: T, when
    the caller knows it (no device sync: repeat_interleave otherwise reads its output size)."""
    total = int(cu_seqlens[-1]) if total is None else total
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


_HOST_COPY = "_megatron_rl_host_copy"  # a device cu_seqlens' host copy, for _rope_thd_on_host


def _packed_seq_params(cu_seqlens: torch.Tensor, bounds: list[int]):
    """megatron's ``PackedSeqParams`` (THD) for the sequences ``cu_seqlens [n + 1]`` (int32, on
    the model's device), whose values ``bounds`` the caller has read: no layer reads them
    from the device again (the attention: ``models.attention.host_bounds``; the RoPE:
    :func:`_rope_thd_on_host`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models.attention import HOST_BOUNDS

    longest = max(z - a for a, z in zip(bounds[:-1], bounds[1:]))
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    setattr(params, HOST_BOUNDS, bounds)
    setattr(cu_seqlens, _HOST_COPY, torch.tensor(bounds, dtype=torch.int32))
    _install_rope_thd_on_host()
    return params


def _rope_thd_on_host(t: torch.Tensor, cu_seqlens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """megatron-core 0.16.1's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``: Llama-4's
    interleaved RoPE on a packed micro-batch, which ``platform.kernels`` leaves unfused) on
    the host copy of ``cu_seqlens`` that :func:`_packed_seq_params` made. It reads the bounds
    at every call, query and key of every layer: ``.tolist()`` (rope_utils.py:204), a tensor
    compared as a bool (211) and, when one sequence fills the pack, ``.item()`` per sequence
    (218): 2-4 device syncs per layer. The same function on the same values: the same output."""
    return _rope_thd_on_host.megatron(
        t, getattr(cu_seqlens, _HOST_COPY, cu_seqlens), *args, **kwargs
    )


def _install_rope_thd_on_host() -> None:
    """Route megatron's THD RoPE (called through its module global, rope_utils.py:303) through
    :func:`_rope_thd_on_host`; once per process."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils._apply_rotary_pos_emb_thd is not _rope_thd_on_host:
        _rope_thd_on_host.megatron = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = _rope_thd_on_host


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, V]`` from vocab shards (tests and tools; not the hot path)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def token_logprobs(
    model, tokens: torch.Tensor, temperature: float = 1.0, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) as ``[b, s-1]`` (float32, differentiable).

    Uses megatron's vocab-parallel cross entropy, so full-vocabulary logits are never gathered.
    With the FP32 head the logits, and so the log-softmax, are FP32. ``temperature`` divides
    the logits first (the distribution a sampler at that temperature draws from).
    """
    return logits_to_logprobs(
        forward_logits(model, tokens, cu_seqlens=cu_seqlens), tokens, temperature
    )


def logits_to_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[b, s-1]`` log-probs of ``tokens[:, 1:]`` from this rank's vocab shard of the logits
    ``[b, s, V/tp]`` (the last pipeline stage's output), as in :func:`token_logprobs`."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = tokens[:, 1:]
    # vocab_parallel_cross_entropy expects [s, b, V/tp] and returns [s, b]. It works on its
    # input in place: that input must be a tensor of its own, never a view (megatron-core
    # 0.16's custom Function; autograd refuses an in-place change of a view in its backward).
    # For b > 1 the transpose's contiguous() copies; for b = 1 (a packed micro-batch) it
    # would return the view itself, so copy then too (the same one copy as b > 1).
    sbv = logits.transpose(0, 1)
    sbv = sbv.contiguous() if not sbv.is_contiguous() else sbv.clone()
    nll = tensor_parallel.vocab_parallel_cross_entropy(sbv, targets.t().contiguous())
    return -nll.t()
