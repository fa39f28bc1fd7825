"""Expected attention: the attention the queries still to come will pay each slot, estimated from past ones.

Expected Attention (Devoto et al., 2025; kvpress's `ExpectedAttentionPress`) models a future query as a Gaussian:
the mean and covariance of the queries seen, before RoPE, rotated to the next ``horizon`` positions
(`expected_attention` gives the score). Queries come after RoPE and any QK norm (why this works on Gemma-3, unlike
kvpress, which re-projects hidden states) and are turned back by their position (`rerotate`); ``attention_scaling``
stays on both sides, so it needs no special case.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_kvgov.policies.rope import rerotate


@dataclass(frozen=True)
class QueryForecast:
    """How to estimate the queries to come, and what to score with them.

    Args:
        queries: how many of the step's last queries make the statistics (None: all of them, as kvpress
            does at prefill). During decode a step has one query: its own direction, with no covariance.
        horizon: the future positions the rotation is averaged over (kvpress: 512).
        covariance: add the covariance term (False: the mean query alone).
        value_norm: multiply each slot's expected attention by the L2 norm of its value.
        running: estimate from every query seen so far (`QueryStatistics`, kept by the cache per layer)
            rather than from the step's own; ``queries`` then bounds nothing.
    """

    queries: int | None = None
    horizon: int = 512
    covariance: bool = True
    value_norm: bool = True
    running: bool = False

    def __post_init__(self) -> None:
        for name in ("queries", "horizon"):
            value = getattr(self, name)
            if value is None and name == "queries":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"QueryForecast.{name} must be a positive int; got {value!r}.")
        for name in ("covariance", "value_norm", "running"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QueryForecast.{name} must be a bool; got {getattr(self, name)!r}.")


@dataclass
class QueryStatistics:
    """Running sums of the queries before RoPE, per row and query head, in float64.

    ``count`` ``[batch]``, ``total`` ``[batch, q_heads, head_dim]`` and ``outer`` ``[batch, q_heads, head_dim x
    (head_dim + 1) / 2]``: the sum of ``q q^T``, symmetric, so only its upper triangle is kept, row by row (half the
    bytes of the square; on Gemma-3 the square was 2 MB a layer and sequence). The mean is ``total / count`` and the
    covariance ``outer / count - mean mean^T``. Rows follow the cache's rows (`select_rows` for beams).
    """

    count: Tensor
    total: Tensor
    outer: Tensor

    @classmethod
    def empty(cls, batch: int, q_heads: int, head_dim: int, device: torch.device) -> QueryStatistics:
        work = torch.float64
        return cls(
            torch.zeros(batch, dtype=work, device=device),
            torch.zeros(batch, q_heads, head_dim, dtype=work, device=device),
            torch.zeros(batch, q_heads, _triangle(head_dim), dtype=work, device=device),
        )

    def add(self, unrotated: Tensor, weights: Tensor) -> None:
        """Add float64 queries ``[batch, q_heads, n, head_dim]`` (before RoPE) with ``weights`` ``[batch, n]``
        (1 for a valid query, 0 for padding)."""
        weighted = unrotated * weights[:, None, :, None]
        self.count += weights.sum(dim=-1)
        self.total += weighted.sum(dim=2)
        rows, cols = _upper(unrotated.shape[-1], unrotated.device)
        self.outer += (weighted.transpose(-1, -2) @ unrotated)[..., rows, cols]

    def moments(self) -> tuple[Tensor, Tensor]:
        """(mean ``[batch, q_heads, head_dim]``, covariance ``[batch, q_heads, head_dim, head_dim]``); zeros for a
        row that has seen no query."""
        count = self.count.clamp(min=1.0)
        mean = self.total / count[:, None, None]
        head_dim = mean.shape[-1]
        rows, cols = _upper(head_dim, mean.device)
        square = self.outer.new_zeros((*self.outer.shape[:-1], head_dim, head_dim))
        square[..., rows, cols] = self.outer
        square[..., cols, rows] = self.outer  # the lower triangle mirrors it (the diagonal written twice, equal)
        covariance = square / count[:, None, None, None] - mean[..., :, None] * mean[..., None, :]
        return mean, covariance

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.count, self.total, self.outer))

    @staticmethod
    def row_bytes(q_heads: int, head_dim: int) -> int:
        """Bytes one row holds: its count, and per query head a sum and the upper triangle of a sum of outer
        products, in float64."""
        return torch.float64.itemsize * (1 + q_heads * head_dim + q_heads * _triangle(head_dim))

    def select_rows(self, rows: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (beam search, batch expansion)."""
        rows = rows.to(self.count.device)
        self.count, self.total, self.outer = (t.index_select(0, rows) for t in (self.count, self.total, self.outer))


def _triangle(head_dim: int) -> int:
    """Entries of a ``head_dim`` x ``head_dim`` matrix's upper triangle, the diagonal included."""
    return head_dim * (head_dim + 1) // 2


@functools.cache
def _upper(head_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(rows, columns) of the upper triangle, row by row: the order `QueryStatistics.outer` keeps it in (built once
    per size and device: every layer's step asks)."""
    indices = torch.triu_indices(head_dim, head_dim, device=device)
    return indices[0], indices[1]


def observe_queries(
    statistics: QueryStatistics | None,
    inv_freq: Tensor,
    query: Tensor,
    query_positions: Tensor,
    query_valid: Tensor,
) -> QueryStatistics:
    """Add this step's valid queries (after RoPE, as in `expected_attention`) to ``statistics`` (None: start
    new ones); returns the statistics."""
    batch, q_heads, _, head_dim = query.shape
    if statistics is None:
        statistics = QueryStatistics.empty(batch, q_heads, head_dim, query.device)
    if statistics.count.shape[0] != batch or statistics.total.shape[1] != q_heads:
        raise ValueError(
            f"The running query statistics hold {statistics.count.shape[0]} rows of {statistics.total.shape[1]} "
            f"query heads; this step has {batch} rows of {q_heads}."
        )
    unrotated = rerotate(query.to(torch.float64), -query_positions[:, None, :], inv_freq)
    statistics.add(unrotated, query_valid.to(torch.float64))
    return statistics


def expected_attention(
    forecast: QueryForecast,
    inv_freq: Tensor,
    query: Tensor,
    query_positions: Tensor,
    query_valid: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    scale: float,
    statistics: QueryStatistics | None = None,
) -> Tensor:
    """Float ``[batch, kv_heads, slots]``: the expected attention of the queries to come to each slot.

    A future query is a Gaussian: the mean ``mu`` and covariance ``Sigma`` of the queries seen, before RoPE,
    rotated to the next ``horizon`` positions by the average rotation ``R``, so the expected attention of the
    slots is a softmax of (``s`` the logit scale)::

        s * (R mu) . k  +  s^2 / 2 * k^T (R Sigma R^T) k

    per KV head, optionally times the slot's value norm (a small value changes the output little).
    ``running=True`` uses every query seen (`QueryStatistics`), since a decode step's one query has no covariance.

    Args:
        forecast: the estimate's configuration.
        inv_freq: ``[rotary_dim / 2]``, the layer's RoPE frequencies.
        query: ``[batch, q_heads, q_len, head_dim]`` this step's queries after RoPE; query head ``i`` reads
            KV head ``i // (q_heads // kv_heads)``.
        query_positions: long ``[batch, q_len]``: each query's RoPE position.
        query_valid: bool ``[batch, q_len]``: False for padding queries, which add nothing.
        keys, values: ``[batch, kv_heads, slots, head_dim]`` as attention reads them (keys after RoPE).
        valid: bool ``[batch, kv_heads, slots]``: the slots a future query may read; the others get 0.
        scale: the logit scale.
        statistics: with ``forecast.running``, the layer's running statistics, this step's queries included
            (`observe_queries`); the moments are read from them instead of from the step's queries.

    A row without a valid query (this step's, or with running statistics any so far) scores every slot 0.
    """
    batch, q_heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    work = torch.float64  # a covariance of logits near 1e3 loses the ranking in float32
    covariance: Tensor | None
    if forecast.running:
        if statistics is None:
            raise ValueError("QueryForecast(running=True) needs the layer's running QueryStatistics; none were given.")
        mean, covariance = statistics.moments()
        has_query = (statistics.count > 0)[:, None, None]
    else:
        mean, covariance = _step_moments(forecast, inv_freq, query, query_positions, query_valid)
        has_query = query_valid.any(dim=-1)[:, None, None]
    turn = _mean_rotation(query_positions, query_valid, forecast.horizon, inv_freq, head_dim)  # [b, d, d]
    future_mean = torch.einsum("bij,bhj->bhi", turn, mean)
    grouped_mean = future_mean.reshape(batch, kv_heads, group, head_dim)
    logits = scale * torch.einsum("bkgd,bksd->bkgs", grouped_mean, keys.to(work))
    if forecast.covariance and covariance is not None:
        future = turn[:, None] @ covariance @ turn[:, None].transpose(-1, -2)
        future = future.reshape(batch, kv_heads, group, head_dim, head_dim)
        keyed = keys.to(work)
        spread = (torch.einsum("bksd,bkgde->bkgse", keyed, future) * keyed[:, :, None]).sum(dim=-1)
        logits = logits + 0.5 * scale**2 * spread
    readable = valid[:, :, None, :]
    probs = logits.masked_fill(~readable, float("-inf")).softmax(dim=-1)
    probs = torch.where(readable.any(dim=-1, keepdim=True), probs, 0.0)
    scores = probs.sum(dim=2)
    if forecast.value_norm:
        scores = scores * values.to(work).norm(dim=-1)
    return torch.where(has_query, scores, 0.0).to(torch.promote_types(query.dtype, torch.float32))


def _step_moments(
    forecast: QueryForecast, inv_freq: Tensor, query: Tensor, query_positions: Tensor, query_valid: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Mean and covariance (None without ``forecast.covariance``) of the step's last ``forecast.queries`` valid
    queries, before RoPE, in float64."""
    q_len = query.shape[2]
    last = q_len if forecast.queries is None else min(forecast.queries, q_len)
    seen = query[:, :, q_len - last :].to(torch.float64)
    weights = query_valid[:, q_len - last :].to(torch.float64)  # [b, n]
    unrotated = rerotate(seen, -query_positions[:, None, q_len - last :], inv_freq)
    count = weights.sum(dim=-1).clamp(min=1.0)[:, None, None]  # [b, 1, 1]
    mean = (unrotated * weights[:, None, :, None]).sum(dim=2) / count  # [b, hq, d]
    if not forecast.covariance:
        return mean, None
    centred = (unrotated - mean[:, :, None]) * weights[:, None, :, None].sqrt()
    covariance = centred.transpose(-1, -2) @ centred / count[..., None]  # [b, hq, d, d]
    return mean, covariance


def _mean_rotation(positions: Tensor, valid: Tensor, horizon: int, inv_freq: Tensor, head_dim: int) -> Tensor:
    """Float64 ``[batch, head_dim, head_dim]``: RoPE's rotation averaged over the ``horizon`` positions after
    each row's newest valid query, in the ``rotate_half`` pairing (channel ``i`` with ``i + rotary_dim/2``);
    channels beyond the rotary ones pass through."""
    newest = torch.where(valid, positions, -1).amax(dim=-1)  # [b]
    ahead = torch.arange(1, horizon + 1, device=positions.device, dtype=torch.float64)
    angles = (newest.to(torch.float64)[:, None] + ahead)[..., None] * inv_freq.to(positions.device, torch.float64)
    cos, sin = angles.cos().mean(dim=1), angles.sin().mean(dim=1)  # [b, rot/2]
    half = inv_freq.shape[0]
    turn = torch.eye(head_dim, dtype=torch.float64, device=positions.device).repeat(positions.shape[0], 1, 1)
    index = torch.arange(half, device=positions.device)
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): rot(x) = x cos + rotate_half(x) sin.
    turn[:, index, index] = cos
    turn[:, index + half, index + half] = cos
    turn[:, index, index + half] = -sin
    turn[:, index + half, index] = sin
    return turn
