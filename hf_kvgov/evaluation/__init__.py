"""The model-free parts of the evaluation suite.

- ``longbench``: the official LongBench data format, prompts, truncation and metrics, reproducing
  THUDM's harness sample for sample (metrics need ``pip install hf-kvgov[eval]``).
- ``synthetic``: RULER-style needle, variable-tracking and common-word tasks built offline from
  any filler text, with a target length in tokens and a seed.
- ``registry``: task names to generators and scorers.
"""

from hf_kvgov.evaluation.registry import (
    SyntheticTask,
    generate_synthetic,
    get_synthetic_task,
    longbench_metric,
    register_synthetic_task,
    score_synthetic,
    synthetic_tasks,
)
from hf_kvgov.evaluation.synthetic import SyntheticSample
from hf_kvgov.evaluation.tokenizer import SupportsEncode, SupportsEncodeDecode

__all__ = [
    "SupportsEncode",
    "SupportsEncodeDecode",
    "SyntheticSample",
    "SyntheticTask",
    "generate_synthetic",
    "get_synthetic_task",
    "longbench_metric",
    "register_synthetic_task",
    "score_synthetic",
    "synthetic_tasks",
]
