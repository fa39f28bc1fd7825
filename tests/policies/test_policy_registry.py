"""Building policies by name, and plugging in a new one without touching shared code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import Tensor

from hf_kvgov.policies import (
    H2O,
    TOVA,
    FactNeeds,
    KeyNorm,
    SinkWindow,
    SlotFacts,
    SnapKV,
    available_policies,
    make_policy,
    register_policy,
    registry,
    select_by_priority,
)


@pytest.fixture
def private_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))


def test_builtin_names() -> None:
    assert make_policy("h2o", heavy=2, recent=3) == H2O(heavy=2, recent=3)
    assert make_policy("sink", n_sink=4, window=60) == SinkWindow(n_sink=4, window=60)
    assert make_policy("snapkv") == SnapKV(window=32, kernel=7, pooling="max")
    assert make_policy("tova") == TOVA()
    assert make_policy("key_norm", recent=8) == KeyNorm(recent=8)
    assert {"h2o", "key_norm", "sink", "snapkv", "tova"} <= set(available_policies())


def test_unknown_name_lists_the_accepted_names() -> None:
    with pytest.raises(ValueError, match=r"policy 'pyramid'.*'h2o', 'key_norm', 'mean_mass', 'sink', 'snapkv', 'tova'"):
        make_policy("pyramid")


def test_config_errors_come_from_the_policy() -> None:
    with pytest.raises(ValueError, match="window must be at least 0"):
        make_policy("sink", n_sink=4, window=-1)
    with pytest.raises(
        ValueError, match=r"'h2o' cannot be built from heavy=2: missing .* 'recent'; it takes \(heavy, recent\)"
    ):
        make_policy("h2o", heavy=2)
    with pytest.raises(
        ValueError, match=r"unexpected keyword argument 'windw'; it takes \(window=32, kernel=7, pooling='max'\)"
    ):
        make_policy("snapkv", windw=16)


@dataclass(frozen=True)
class LowestMass:
    """A policy written against the shared routine in one line: keep the least-attended slots."""

    needs: ClassVar[FactNeeds] = FactNeeds(mass=True)

    @property
    def min_budget(self) -> int:
        return 1

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        mass = facts.require("mass", "LowestMass")
        return select_by_priority(-mass, positions, valid, min(budget, positions.shape[-1]))


@pytest.mark.usefixtures("private_registry")
def test_a_new_policy_plugs_in_by_name() -> None:
    register_policy("lowest", LowestMass)
    policy = make_policy("lowest")
    scores = torch.tensor([[[5.0, 1.0, 3.0, 0.0]]])
    positions = torch.tensor([[[0, 1, 2, 3]]])
    keep = policy.select(SlotFacts(mass=scores), positions, torch.ones(1, 1, 4, dtype=torch.bool), 2)
    assert keep.view(-1).tolist() == [1, 3]
    assert "lowest" in available_policies()


@pytest.mark.usefixtures("private_registry")
def test_names_are_not_silently_replaced() -> None:
    with pytest.raises(ValueError, match=r"'sink' is already registered.*replace=True"):
        register_policy("sink", LowestMass)
    register_policy("sink", LowestMass, replace=True)
    assert isinstance(make_policy("sink"), LowestMass)


def test_registry_changes_above_did_not_leak() -> None:
    assert "lowest" not in available_policies()
    assert isinstance(make_policy("sink", n_sink=1, window=1), SinkWindow)


@pytest.mark.usefixtures("private_registry")
def test_empty_name_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        register_policy("", LowestMass)


def test_the_policy_s_old_name_warns_and_gives_h2o() -> None:
    import hf_kvgov.policies as policies

    with pytest.warns(DeprecationWarning, match=r"now hf_kvgov\.policies\.H2O"):
        assert policies.HeavyHitter is H2O
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        policies.Nope  # noqa: B018
