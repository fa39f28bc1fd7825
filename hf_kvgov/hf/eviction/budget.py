"""Budgets moved to `hf_kvgov.policies.budget` (model-free); this name stays while imports move."""

from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec, fraction_of, resolve_budget

__all__ = ["BudgetSpec", "check_budget_spec", "fraction_of", "resolve_budget"]
