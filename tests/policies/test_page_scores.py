"""Page summaries for recall, by hand: Quest's bound from a key box, the centroid score, and what recall keeps."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.planner.setup import RECALL_SUMMARY_ROWS
from hf_kvgov.policies.page_bounds import page_centroid_scores, page_upper_bounds
from hf_kvgov.tiers.recall_pages import SUMMARY_ROWS, Recall

# One row, one KV head read by two query heads, head_dim 2, three pages.
QUERY = torch.tensor([[[[1.0, 0.0]], [[0.0, -1.0]]]])  # [1, 2 q heads, 1 query, 2]
PAGE_MIN = torch.tensor([[[[-5.0, -5.0], [0.9, 0.0], [0.0, 0.0]]]])  # page 0: a wide box around the origin
PAGE_MAX = torch.tensor([[[[5.0, 5.0], [1.1, 0.0], [0.0, 0.0]]]])  # page 1: keys near (1, 0)
MEANS = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [0.0, -0.5]]]])
VALID = torch.tensor([[[True, True, False]]])


def test_the_bound_is_the_best_corner_of_each_box_over_the_group() -> None:
    bounds = page_upper_bounds(QUERY, PAGE_MIN, PAGE_MAX, VALID)
    # Page 0: head 0 scores x <= 5, head 1 scores -y <= 5; page 1: head 0 1.1, head 1 0. Page 2 is not written.
    assert bounds.tolist() == [[[5.0, pytest.approx(1.1), float("-inf")]]]


def test_the_centroid_score_follows_the_mean_key_where_the_bound_follows_the_widest_box() -> None:
    scores = page_centroid_scores(QUERY, MEANS, VALID)
    # Page 0's mean is the origin (0 for both heads); page 1's scores 1 for head 0: it now ranks first.
    assert scores.tolist() == [[[0.0, 1.0, float("-inf")]]]
    assert page_upper_bounds(QUERY, PAGE_MIN, PAGE_MAX, VALID).argmax(-1).item() == 0
    assert scores.argmax(-1).item() == 1


def test_centroid_scores_refuse_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="centroids \\[batch, kv_heads, pages, head_dim\\]"):
        page_centroid_scores(QUERY, torch.zeros(1, 1, 3, 4), VALID)


def test_the_planner_and_the_tier_count_the_same_summary_rows() -> None:
    assert RECALL_SUMMARY_ROWS == SUMMARY_ROWS == {"bounds": 2, "centroid": 1}


@pytest.mark.parametrize(("summary", "kept"), [("bounds", 61), ("centroid", 91)])
def test_kept_within_pays_the_pages_and_one_summary_per_written_page(summary: str, kept: int) -> None:
    # 200 resident slot-equivalents over 1,000 tokens, 4 recalled pages of 16 and one pending page: 80 slots.
    # Bounds (a min and a max are one token's K/V): 61 + 80 + ceil(939 / 16) = 59 is 200; 62 kept make 201.
    # Centroid (half a token per page): 91 + 80 + ceil(57 / 2) = 29 is 200; 92 kept make 201.
    recall = Recall(pages=4, page_tokens=16, summary=summary)
    assert recall.kept_within(200, 1000) == kept
    rows = SUMMARY_ROWS[summary]

    def resident(budget: int) -> int:
        pages = -(-(1000 - budget) // 16)
        return budget + 80 + -(-pages * rows // 2)

    assert resident(kept) <= 200 < resident(kept + 1)


def test_an_unknown_summary_is_named() -> None:
    with pytest.raises(ValueError, match="summary must be one of bounds, centroid; got 'mean'"):
        Recall(summary="mean")
