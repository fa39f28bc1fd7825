"""The article's §7 scenario (LLaMA-13B in fp16 on one 80 GB A100, 2,048-token users), claim by claim.

Each claim is set next to the planner's figure with a plain verdict. Where a claim does not hold, the
note says what the workload would need for it to hold (how short the users, how much of every prompt
shared, how small the H2O budget), so the reader can judge whether their own workload gets there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hf_kvgov.planner.lengths import fixed
from hf_kvgov.planner.planner import Plan, PlanInputs, StepResult, evaluate
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.planner.units import format_bytes


@dataclass(frozen=True)
class Scenario:
    """A preset: the inputs the article states, and the chain in the article's order."""

    name: str
    model: str
    memory: str
    weight_dtype: str
    kv_dtype: str
    user_tokens: int
    chain: tuple[str, ...]
    description: str


BRIEF = Scenario(
    name="brief",
    model="LLaMA-13B",
    # An "80 GB" A100 has 81,920 MiB = 80 GiB (85.9 GB).
    memory="80GiB",
    weight_dtype="fp16",
    kv_dtype="fp16",
    user_tokens=2048,
    chain=("static", "paged", "prefix", "h2o", "int8", "spill"),
    description="the article's §7: LLaMA-13B, fp16 weights and KV, one 80 GB A100, 2,048-token users",
)
SCENARIOS: dict[str, Scenario] = {BRIEF.name: BRIEF}

# The article's figures: bytes per token and per user (§1), users per step of the chain (§7).
CLAIMED_BYTES_PER_TOKEN = 5.1e6
CLAIMED_BYTES_PER_USER = 10.4e9
CLAIMED_USERS = {"paged": 64, "prefix": 256, "h2o": 1024, "int8": 1536}
CLAIMED_COST_REDUCTION = 0.95


@dataclass(frozen=True)
class Claim:
    """One claim of the article next to the planner's figure."""

    what: str
    claimed: str
    computed: str
    holds: bool
    note: str

    @property
    def verdict(self) -> str:
        return "holds" if self.holds else "does NOT hold"


def find_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"Unknown scenario {name!r}; available: {', '.join(SCENARIOS)}.")
    return SCENARIOS[name]


def _first(values: Iterable[float], reaches: Callable[[float], bool]) -> float | None:
    return next((v for v in values if reaches(v)), None)


def _max_tokens_for(inputs: PlanInputs, setup: CacheSetup, users: int) -> int:
    """The longest fixed length at which ``users`` sequences fit under ``setup`` (0 if none)."""
    lo, hi = 0, inputs.geometry.max_position_embeddings * 64
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = evaluate(dataclasses.replace(inputs, lengths=fixed(mid)), setup).concurrent >= users
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def _fits_with(inputs: PlanInputs, target: int, make: Callable[[float], CacheSetup]) -> Callable[[float], bool]:
    """Whether ``target`` sequences fit under the setup ``make(value)``."""
    return lambda value: evaluate(inputs, make(value)).concurrent >= target


def _paged_note(inputs: PlanInputs, step: StepResult, target: int) -> str:
    tokens = _max_tokens_for(inputs, step.setup, target)
    return (
        f"{target} users fit only if each holds at most {tokens:,} tokens; paging gains nothing over "
        "pre-allocation when every user is as long as the buffer (it gains when most are shorter)."
    )


def _prefix_note(inputs: PlanInputs, step: StepResult, target: int) -> str:
    fits = _fits_with(inputs, target, lambda v: dataclasses.replace(step.setup, shared_fraction=v))
    needed = _first((i / 100 for i in range(100)), fits)
    assumed = f"(assumed here: {step.setup.shared_fraction:.0%}; set --shared-fraction)"
    if needed is None:
        return f"not reachable even with 99% of every prompt shared {assumed}."
    return f"needs at least {needed:.0%} of every user's tokens to be one shared prefix {assumed}."


def _h2o_note(inputs: PlanInputs, step: StepResult, target: int) -> str:
    fits = _fits_with(inputs, target, lambda v: dataclasses.replace(step.setup, h2o_budget=v))
    needed = _first((i / 100 for i in range(100, 0, -1)), fits)
    budget = f"budget here: {step.setup.h2o_budget:.0%}"
    if needed is None:
        return (
            "not reachable even keeping 1% of each user's own tokens, since the "
            f"{step.setup.h2o_recent}-token recent window and any shared prefix stay whole ({budget})."
        )
    return f"needs H2O to keep at most {needed:.0%} of each user's own tokens ({budget})."


def _codec_note(inputs: PlanInputs, step: StepResult, target: int) -> str:
    return (
        "int8 codes are half of fp16, but per-channel key scales, per-token value scales and the "
        f"full-precision sink and tail blocks leave x{step.vs_previous or 0:.2f} over the previous step here."
    )


_NOTES: dict[str, Callable[[PlanInputs, StepResult, int], str]] = {
    "paged": _paged_note,
    "prefix": _prefix_note,
    "h2o": _h2o_note,
    "int8": _codec_note,
}
_LABELS = {
    "paged": "users, paged",
    "prefix": "users, + prefix sharing",
    "h2o": "users, + H2O",
    "int8": "users, + int8",
}


def _bytes_claims(plan: Plan, scenario: Scenario) -> list[Claim]:
    g, budget = plan.inputs.geometry, plan.inputs.budget
    per_token = g.kv_bytes_per_token(plan.options.kv_dtype)
    per_user = per_token * scenario.user_tokens
    element = per_token // (2 * g.num_layers * g.num_kv_heads * g.head_dim)
    formula = f"2 x {g.num_layers} x {g.num_kv_heads} x {g.head_dim} x {element} B = {per_token:,} B"
    at_claim, claimed_paged = int(budget.kv_bytes // CLAIMED_BYTES_PER_USER), CLAIMED_USERS["paged"]
    token_ratio, user_ratio = CLAIMED_BYTES_PER_TOKEN / per_token, CLAIMED_BYTES_PER_USER / per_user
    return [
        Claim(
            "KV bytes per token",
            format_bytes(CLAIMED_BYTES_PER_TOKEN),
            f"{per_token:,} B",
            abs(token_ratio - 1) < 0.05,
            f"{token_ratio:.1f}x too high: {formula} = {format_bytes(per_token)}.",
        ),
        Claim(
            f"KV bytes per {scenario.user_tokens:,}-token user",
            format_bytes(CLAIMED_BYTES_PER_USER),
            f"{per_user:,} B",
            abs(user_ratio - 1) < 0.05,
            f"{user_ratio:.1f}x too high: {per_token:,} B x {scenario.user_tokens:,} = "
            f"{format_bytes(per_user)}. At the article's own 10.4 GB per user, the "
            f"{format_bytes(budget.kv_bytes)} left for KV would hold {at_claim} users, not {claimed_paged}.",
        ),
    ]


def _user_claims(plan: Plan) -> list[Claim]:
    claims, previous_claim = [], None
    for name, target in CLAIMED_USERS.items():
        step = plan.step(name)
        claimed = f"{target:,}" + (f" (x{target / previous_claim:.1f})" if previous_claim else "")
        computed = f"{step.concurrent:,}" + (
            f" (x{step.vs_previous:.2f})" if previous_claim and step.vs_previous else ""
        )
        holds = step.concurrent >= target
        note = "holds at these inputs." if holds else _NOTES[name](plan.inputs, step, target)
        claims.append(Claim(_LABELS[name], claimed, computed, holds, note))
        previous_claim = target
    return claims


def _cost_claim(plan: Plan) -> Claim:
    paged, last = plan.step("paged").concurrent, plan.step("int8").concurrent
    reduction = 1 - paged / last if last else 0.0
    static = plan.steps[0].concurrent
    return Claim(
        "cost per user, full chain vs paged",
        f"-{CLAIMED_COST_REDUCTION:.0%}",
        f"-{reduction:.1%}",
        reduction >= CLAIMED_COST_REDUCTION,
        f"{paged:,} -> {last:,} users (vs static pre-allocation: {static:,} -> {last:,}); lower cost assumes "
        "the quality loss of H2O and int8 is acceptable, which this plan does not measure.",
    )


def check_claims(plan: Plan, scenario: Scenario = BRIEF) -> list[Claim]:
    """The article's claims, each with the planner's figure and a verdict (needs the article's chain)."""
    missing = [n for n in CLAIMED_USERS if n not in {s.name for s in plan.steps}]
    if missing:
        raise ValueError(
            f"Checking the article's claims needs the chain steps {missing}; use the chain {','.join(scenario.chain)}."
        )
    return _bytes_claims(plan, scenario) + _user_claims(plan) + [_cost_claim(plan)]
