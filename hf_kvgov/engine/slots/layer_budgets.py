"""Per-layer budgets: ``layer_budgets={0: 1.0, 5: 128}`` gives the layers it names their own budget.

Each layer's budget is an int (slots per sequence and KV head) or a float fraction of the same length as
the cache's ``budget`` (``budget_of``, or generate's prompt), which every layer not named keeps. Int budgets,
and the policies for them, are fixed on construction (so a budget a policy cannot serve is refused at once);
fractions are resolved on the first forward (see ``budget_basis``) and forgotten again by ``reset``.

``layer_budgets=Pyramid()`` instead splits the cache's budget, once it is a number of slots, over the layers
that evict (`hf_kvgov.policies.pyramid`): the same total, more in the lower layers. Within a layer,
``head_budgets=HeadAdaptive()`` shares its budget among the KV heads; `check_head_budgets` checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hf_kvgov.policies import EvictionPolicy, HeadAdaptive
from hf_kvgov.policies.base import ranking_of
from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec, resolve_budget
from hf_kvgov.policies.pyramid import Pyramid

# What a cache's ``layer_budgets`` accepts: explicit budgets per layer, an allocator over layers, or None.
LayerBudgetSpec = Mapping[int, BudgetSpec] | Pyramid | None


def check_layer_budgets(owner: str, layer_budgets: object, num_layers: int) -> dict[int, BudgetSpec]:
    """``layer_budgets`` as a dict from layer index to budget, sorted, after checking every entry.

    Raises TypeError unless it is a mapping (None or a `Pyramid`: no overrides) from int layer indices to
    budgets, and ValueError for an index outside ``0..num_layers-1`` or a budget `check_budget_spec` refuses.
    """
    if layer_budgets is None or isinstance(layer_budgets, Pyramid):
        return {}
    if not isinstance(layer_budgets, Mapping):
        raise TypeError(
            f"{owner}: layer_budgets must map layer indices to budgets, as in {{0: 1.0, 3: 128}}, or be an "
            f"allocator such as Pyramid(); got {layer_budgets!r} of type {type(layer_budgets).__name__}."
        )
    checked: dict[int, BudgetSpec] = {}
    for layer, spec in layer_budgets.items():
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"{owner}: layer_budgets keys must be int layer indices; got {layer!r}.")
        if not 0 <= layer < num_layers:
            raise ValueError(
                f"{owner}: layer_budgets names layer {layer}, but the model has layers 0..{num_layers - 1}."
            )
        check_budget_spec(owner, f"layer_budgets[{layer}]", spec)
        checked[layer] = spec
    return dict(sorted(checked.items()))


class LayerBudgets:
    """Each layer's budget spec, its resolved budget in slots (None until resolved) and its policy.

    Args:
        owner: the cache's class name, for error messages.
        default: the budget of every layer ``overrides`` does not name.
        overrides: checked per-layer budgets (see `check_layer_budgets`).
        num_layers: decoder layers of the model.
        policy_for: budget -> the policy that keeps that many slots (may raise if the budget cannot fit it).
        min_budget: the fewest slots the policy keeps; an int budget below it is refused, a fraction raised to it.
        allocator: a `Pyramid` that splits the resolved ``default`` over ``evicting`` (None: every layer
            not overridden keeps ``default``).
        evicting: the layers that evict (not sliding-window layers), lowest first: the allocator's layers.
    """

    def __init__(
        self,
        owner: str,
        default: BudgetSpec,
        overrides: Mapping[int, BudgetSpec],
        num_layers: int,
        policy_for: Callable[[int], EvictionPolicy],
        min_budget: int,
        allocator: Pyramid | None = None,
        evicting: Sequence[int] = (),
    ) -> None:
        for layer, spec in overrides.items():
            if isinstance(spec, int) and spec < min_budget:
                raise ValueError(
                    f"{owner}: layer_budgets gives layer {layer} a budget of {spec} slots, but this cache always "
                    f"keeps at least {min_budget} per KV head; give it at least {min_budget}, or a fraction."
                )
        self.specs: tuple[BudgetSpec, ...] = tuple(overrides.get(i, default) for i in range(num_layers))
        self._default = default
        self._allocator = allocator
        self._allocated = () if allocator is None else tuple(i for i in evicting if i not in overrides)
        self._policy_for = policy_for
        self._min_budget = min_budget
        self.budgets: list[int | None] = [None] * num_layers
        self.policies: list[EvictionPolicy | None] = [None] * num_layers
        self.reset()

    @property
    def resolved(self) -> bool:
        return all(budget is not None for budget in self.budgets)

    def resolve(self, first_length: int) -> None:
        """Fix every fractional budget as a share of ``first_length`` tokens (see ``budget_basis``)."""
        policies: dict[int, EvictionPolicy] = {}
        if self._allocated and self.budgets[self._allocated[0]] is None:
            self._allocate(resolve_budget(self._default, first_length, self._min_budget), policies)
        for layer, spec in enumerate(self.specs):
            if self.budgets[layer] is None:
                self._set(layer, resolve_budget(spec, first_length, self._min_budget), policies)

    def reset(self) -> None:
        """Forget fractional budgets (the next prompt resolves them again); int budgets stay."""
        policies: dict[int, EvictionPolicy] = {}
        for layer, spec in enumerate(self.specs):
            self.budgets[layer], self.policies[layer] = None, None
            if isinstance(spec, int):
                self._set(layer, spec, policies)
        if isinstance(self._default, int) and self._allocated:
            self._allocate(self._default, policies)

    def _allocate(self, budget: int, policies: dict[int, EvictionPolicy]) -> None:
        assert self._allocator is not None
        for layer, share in self._allocator.split(budget, self._allocated, self._min_budget).items():
            self._set(layer, share, policies)

    def _set(self, layer: int, budget: int, policies: dict[int, EvictionPolicy]) -> None:
        # Layers with the same budget share one policy object: policies are immutable and pure.
        if budget not in policies:
            policies[budget] = self._policy_for(budget)
        self.budgets[layer], self.policies[layer] = budget, policies[budget]


def check_head_budgets(
    owner: str,
    head_budgets: object,
    policy_for: Callable[[int], EvictionPolicy],
    min_budget: int,
    decode_policy: EvictionPolicy | None,
) -> HeadAdaptive | None:
    """``head_budgets`` once checked: None, or a `HeadAdaptive` whose policies can rank slots across heads."""
    if head_budgets is None:
        return None
    if not isinstance(head_budgets, HeadAdaptive):
        raise TypeError(
            f"{owner}: head_budgets must be HeadAdaptive(floor=...) or None; got {head_budgets!r} of type "
            f"{type(head_budgets).__name__}."
        )
    for chooser in (policy_for(max(min_budget, 1)), decode_policy):
        if chooser is not None:
            ranking_of(chooser, f"{owner} with head_budgets")
    return head_budgets
