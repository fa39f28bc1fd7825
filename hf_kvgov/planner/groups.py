"""What each kind of layer costs one sequence, as the library groups layers (`hf_kvgov.storage.layer_groups`).

Layers are grouped by window into groups of one size, the gcd of each kind's count (Gemma-3-270M: five sliding
groups and one full group of three layers). At a length of L tokens one layer of each kind holds::

    paged, full attention:    ceil(L / bs) * bs tokens
    paged, sliding window w:  ceil(L / bs) * bs - first_kept(L - 1): the blocks overlapping the last window
    static buffer:            max_len tokens (a sliding layer: min(max_len, w))

times its KV heads' keys and values; the kinds add up to a plain paged (or static) step. Codecs, sharing, H2O and
spill are left out: this splits the uncompressed cache, the figure the layer groups change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_kvgov.planner.accounting import first_kept_token, held_window
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.storage.layer_groups import LayerGroup, layer_groups


@dataclass(frozen=True)
class KindBytes:
    """One kind of layer (full attention, or one sliding window) at one sequence length.

    ``tokens`` is what one layer holds for the sequence (whole blocks); ``bytes_per_token`` is
    ``bytes_per_sequence`` over the length, and ``share`` its part of all kinds' bytes.
    """

    window: int | None
    layers: int
    groups: int
    tokens: int
    bytes_per_token: float
    bytes_per_sequence: int
    share: float


@dataclass(frozen=True)
class GroupBytes:
    """Every kind of layer at ``length`` tokens; each group holds ``group_size`` layers."""

    length: int
    group_size: int
    kinds: tuple[KindBytes, ...]

    @property
    def bytes_per_sequence(self) -> int:
        return sum(kind.bytes_per_sequence for kind in self.kinds)


def _check_plain(setup: CacheSetup, length: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"A sequence length must be a positive int; got {length!r}.")
    if setup.codec or setup.shared_fraction or setup.h2o_budget is not None or setup.spill_hot_tokens is not None:
        raise ValueError(
            "Bytes per layer group are for a plain paged or static cache; this setup also has a codec, "
            "prefix sharing, H2O or spill. Pass the setup of the 'paged' or 'static' step."
        )
    if not setup.paged and setup.max_len is not None and length > setup.max_len:
        raise ValueError(f"A sequence of {length} tokens does not fit a static buffer of {setup.max_len}.")


def layer_tokens(group: LayerGroup, setup: CacheSetup, length: int) -> int:
    """Tokens one layer of ``group`` holds for a sequence of ``length`` tokens under ``setup``."""
    if not setup.paged:
        assert setup.max_len is not None
        return setup.max_len if group.window is None else min(setup.max_len, group.window)
    bs = setup.block_size
    return math.ceil(length / bs) * bs - first_kept_token(held_window(setup, group.window), length, bs)


def group_bytes(geometry: ModelGeometry, setup: CacheSetup, length: int) -> GroupBytes:
    """Layers, tokens held and bytes of each kind of layer for one sequence of ``length`` tokens."""
    _check_plain(setup, length)
    groups = layer_groups(geometry.layer_windows())
    by_kind: dict[int | None, list[LayerGroup]] = {}
    for group in groups:
        by_kind.setdefault(group.window, []).append(group)
    size = len(groups[0].layers)
    rows = []
    for window, members in by_kind.items():
        tokens = layer_tokens(members[0], setup, length)
        per_layer = geometry.num_kv_heads * setup.full_format.block_bytes(tokens, geometry.head_dim)
        rows.append((window, len(members), tokens, len(members) * size * per_layer))
    total = sum(row[3] for row in rows)
    kinds = tuple(
        KindBytes(window, groups * size, groups, tokens, per_seq / length, per_seq, per_seq / total)
        for window, groups, tokens, per_seq in rows
    )
    return GroupBytes(length, size, kinds)
