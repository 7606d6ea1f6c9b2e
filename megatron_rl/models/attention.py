"""Core attention on torch SDPA, with the Llama-4 pieces megatron-core 0.16.1 lacks.

Used in the local (CPU) layer spec, and on GPU for layers that need chunked local attention or
attention temperature tuning (Transformer Engine has neither). Same interface as megatron's
``DotProductAttention``: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.

Positions are the token indices 0..s-1 of the (unpacked, right-padded) training sequence. A
packed micro-batch (megatron's THD layout: ``packed_seq_params`` with ``cu_seqlens``, query
``[t, np, hn]``, see ``trainer.packing``) is attended one sequence at a time, each exactly as
it would be alone (positions from 0, its own chunks, no key of another sequence): the
block-diagonal causal attention Transformer Engine's ``thd`` kernels compute, with no mask
built (each call stays ``is_causal``, so SDPA keeps its flash kernel on GPU).

No explicit mask is built unless megatron passes one: plain causal attention and chunked local
attention (block-diagonal causal, one causal SDPA call over the chunks as a batch) both use
``is_causal=True``, which keeps SDPA on its flash kernel on GPU. An explicit mask with GQA sends
SDPA to its math kernel (flash rejects masks, memory-efficient attention rejects GQA), which
keeps O(s^2) fp32 scores for backward: ~10.7 GB per layer at Scout's 16k tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

HOST_BOUNDS = "_megatron_rl_host_bounds"  # PackedSeqParams attribute: cu_seqlens_q as a list


def host_bounds(params) -> list[int]:
    """``params.cu_seqlens_q`` as a host list, read once per forward: every layer gets the
    same ``PackedSeqParams`` object, and reading a CUDA tensor is a device sync that would
    stop the host from queueing ahead at each layer (Scout: SDPA on every layer). Kept on
    the params object, whose life is the micro-batch's forward (and its recompute);
    ``models.logprobs`` puts the bounds it has read there when it makes the params."""
    bounds = getattr(params, HOST_BOUNDS, None)
    if bounds is None:
        bounds = params.cu_seqlens_q.tolist()
        setattr(params, HOST_BOUNDS, bounds)
    return bounds


class SDPACoreAttention(MegatronModule):
    """Causal softmax attention via ``torch.nn.functional.scaled_dot_product_attention``.

    ``chunk_size``: Llama-4 chunked local attention (a query sees only keys of its own chunk).
    ``temperature``: ``(floor_scale, attn_scale)`` for Llama-4 attention temperature tuning on
    NoPE layers: queries are scaled by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        chunk_size: int | None = None,
        temperature: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.chunk_size = chunk_size
        self.temperature = temperature

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        return self._padded(query, key, value, attention_mask)

    def _packed(self, query, key, value, attention_mask, params) -> torch.Tensor:
        """THD: ``[t, np, hn]`` (k/v ``[t, ng, hn]``) -> ``[t, 1, np*hn]``, each sequence of
        ``params.cu_seqlens_q`` attended alone."""
        if params.qkv_format != "thd" or attention_mask is not None:
            raise NotImplementedError(
                f"packed sequences: only qkv_format 'thd' without a mask (got "
                f"{params.qkv_format!r}, mask {attention_mask is not None})"
            )
        kv = params.cu_seqlens_kv  # the same tensor as the query's (models.logprobs): no sync
        if (
            kv is not None
            and kv is not params.cu_seqlens_q
            and not torch.equal(kv, params.cu_seqlens_q)
        ):
            raise NotImplementedError("packed sequences: cu_seqlens_kv must equal cu_seqlens_q")
        bounds = host_bounds(params)
        if bounds[-1] != query.shape[0]:
            raise ValueError(
                f"cu_seqlens end at {bounds[-1]}, the query has {query.shape[0]} tokens"
            )
        parts = [
            self._padded(*(t[a:z].unsqueeze(1) for t in (query, key, value)), None)
            for a, z in zip(bounds[:-1], bounds[1:])
            if z > a
        ]
        return torch.cat(parts)

    def _padded(self, query, key, value, attention_mask) -> torch.Tensor:
        """``[s, b, np, hn]`` (k/v ``[s, b, ng, hn]``) -> ``[s, b, np*hn]``, causal."""
        s, b, heads, hn = query.shape
        if key.shape[0] != s:
            raise NotImplementedError(
                f"query length {s} != key length {key.shape[0]}: only full-sequence "
                "(training / prefill) attention is supported"
            )
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = torch.arange(s, device=query.device, dtype=torch.float32)
            scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            query = (query * scale.view(s, 1, 1, 1)).to(query.dtype)
        # megatron convention: True = masked out; SDPA's: True = may attend
        allowed = None if attention_mask is None else ~attention_mask.bool()
        chunk = self.chunk_size
        if chunk is None or s <= chunk:
            out = self._attend(*(_bhsd(t) for t in (query, key, value)), allowed)
            return out.permute(2, 0, 1, 3).reshape(s, b, heads * hn)
        # Chunked local attention is block-diagonal causal attention: the full chunks become
        # a batch of independent causal sequences (``is_causal``, so SDPA can take its flash
        # kernel on GPU, and scores are O(s x chunk), never O(s^2)); a last partial chunk is
        # one more causal sequence.
        full = s // chunk * chunk
        parts = []
        if full:
            n = full // chunk
            q, k, v = (_chunks(t[:full], chunk) for t in (query, key, value))
            out = self._attend(q, k, v, _diagonal_blocks(allowed, full, chunk, b))
            parts.append(
                out.view(n, b, heads, chunk, hn).permute(0, 3, 1, 2, 4).reshape(full, b, -1)
            )
        if full < s:
            tail = None if allowed is None else allowed[..., full:, full:]
            out = self._attend(*(_bhsd(t[full:]) for t in (query, key, value)), tail)
            parts.append(out.permute(2, 0, 1, 3).reshape(s - full, b, heads * hn))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal SDPA on ``[B, h, L, d]`` (k/v ``[B, g, L, d]``); ``allowed``: an optional
        boolean ``[..., L, L]`` "may attend" mask, ANDed with causality."""
        L = q.shape[-2]
        if allowed is not None:
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            allowed = allowed & causal
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=allowed is None,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` -> ``[b, h, s, d]`` (a view)."""
    return t.permute(1, 2, 0, 3)


def _chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[n*chunk, b, h, d]`` -> ``[n*b, h, chunk, d]`` (chunk-major batch)."""
    s, b, h, d = t.shape
    return t.view(s // chunk, chunk, b, h, d).permute(0, 2, 3, 1, 4).reshape(-1, h, chunk, d)


def _diagonal_blocks(
    allowed: torch.Tensor | None, full: int, chunk: int, b: int
) -> torch.Tensor | None:
    """The diagonal ``[chunk, chunk]`` blocks of a ``[..., s, s]`` mask as ``[n*b, 1|h, c, c]``,
    in the chunk-major batch order of :func:`_chunks`."""
    if allowed is None:
        return None
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    allowed = allowed.expand(b, -1, -1, -1)
    blocks = [allowed[..., i : i + chunk, i : i + chunk] for i in range(0, full, chunk)]
    return torch.stack(blocks).flatten(0, 1)
