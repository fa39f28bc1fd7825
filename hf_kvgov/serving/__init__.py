"""Continuous batching on one governed block pool: `ServingEngine`, its requests and its background loop."""

from hf_kvgov.serving.engine import EngineStats, ServingEngine
from hf_kvgov.serving.loop import EngineLoop, RequestStream
from hf_kvgov.serving.request import RequestState, SamplingParams, TokenEvent
from hf_kvgov.serving.transformers_api import GovernedBatchingManager, install, uninstall

__all__ = [
    "EngineLoop",
    "EngineStats",
    "GovernedBatchingManager",
    "RequestState",
    "RequestStream",
    "SamplingParams",
    "ServingEngine",
    "TokenEvent",
    "install",
    "uninstall",
]
