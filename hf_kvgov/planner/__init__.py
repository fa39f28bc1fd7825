"""Capacity planning: how many sequences fit on one accelerator, step by step along the governance chain.

Pure Python: nothing here imports torch, and transformers only to read a cached hub config.

    >>> from hf_kvgov.planner import resolve_model
    >>> resolve_model("LLaMA-13B").kv_bytes_per_token("fp16")
    819200
"""

from hf_kvgov.planner.accounting import SequenceBytes, sequence_bytes, shared_store_bytes
from hf_kvgov.planner.assumptions import plan_assumptions
from hf_kvgov.planner.catalog import BUILTIN_MODELS, known_model_names
from hf_kvgov.planner.chain import DEFAULT_CHAIN, ChainOptions, parse_chain
from hf_kvgov.planner.config_loading import (
    estimate_params,
    geometry_from_config,
    load_config_file,
    load_hub_config,
    resolve_model,
)
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.groups import GroupBytes, KindBytes, group_bytes
from hf_kvgov.planner.layout import codec_format
from hf_kvgov.planner.lengths import LengthDistribution, fixed, lognormal, parse_lengths
from hf_kvgov.planner.memory import DEFAULT_RESERVE, MemoryBudget, budget_for_model
from hf_kvgov.planner.planner import Plan, PlanInputs, StepResult, evaluate, make_plan
from hf_kvgov.planner.plot import plot_plan
from hf_kvgov.planner.report import plan_to_dict, render_plan
from hf_kvgov.planner.scenario import BRIEF, Claim, Scenario, check_claims
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.planner.units import format_bytes, kv_dtype_bytes, parse_memory, weight_dtype_bytes

__all__ = [
    "BRIEF",
    "BUILTIN_MODELS",
    "DEFAULT_CHAIN",
    "DEFAULT_RESERVE",
    "CacheSetup",
    "ChainOptions",
    "Claim",
    "GroupBytes",
    "KindBytes",
    "LengthDistribution",
    "MemoryBudget",
    "ModelGeometry",
    "Plan",
    "PlanInputs",
    "Scenario",
    "SequenceBytes",
    "StepResult",
    "budget_for_model",
    "check_claims",
    "codec_format",
    "estimate_params",
    "evaluate",
    "fixed",
    "format_bytes",
    "geometry_from_config",
    "group_bytes",
    "known_model_names",
    "kv_dtype_bytes",
    "load_config_file",
    "load_hub_config",
    "lognormal",
    "make_plan",
    "parse_chain",
    "parse_lengths",
    "parse_memory",
    "plan_assumptions",
    "plan_to_dict",
    "plot_plan",
    "render_plan",
    "resolve_model",
    "sequence_bytes",
    "shared_store_bytes",
    "weight_dtype_bytes",
]
