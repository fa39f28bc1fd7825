"""transformers' own continuous-batching entry points, run by the governed engine.

`install(model, **engine_args)` gives one model an `init_continuous_batching` that returns a
`GovernedBatchingManager` (a `ServingEngine` and its `EngineLoop` behind the methods of transformers'
`ContinuousBatchingManager` that its callers use). transformers' `generate_batch` and
`continuous_batching_context_manager` call `init_continuous_batching`, so both then run on hf_kvgov's pool, prefix
tree and scheduler unchanged; `uninstall(model)` gives the model transformers' own back.

    hf_kvgov.serving.install(model, max_bytes=4 << 30)
    results = model.generate_batch([ids_a, ids_b], max_new_tokens=64)   # {request id: GenerationOutput}
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_kvgov.hf.compat import TRANSFORMERS_VERSION, GenerationOutput, RequestStatus
from hf_kvgov.serving.engine import ServingEngine
from hf_kvgov.serving.loop import EngineLoop
from hf_kvgov.serving.request import SamplingParams, TokenEvent

_INSTALLED = "_kvgov_engine_args"
# Under `transformers serve` this logger's lines come out with the server's own (its `transformers.cli` loggers).
logger = logging.getLogger("transformers.cli.kvgov")


@dataclass
class _LoopStatus:
    """What transformers' server reads of a batching manager's background thread."""

    fatal_error: BaseException | None = None


@dataclass(frozen=True)
class _SamplingKeys:
    """The per-request sampling settings the manager takes, by name and type (transformers' server asks)."""

    supported_keys: dict[str, type] = field(
        default_factory=lambda: {"temperature": float, "top_p": float, "top_k": int}
    )


def install(model: Any, **engine_args: Any) -> None:
    """Make `model`'s continuous batching (`generate_batch`, the context manager) run on a `ServingEngine`.

    `engine_args` are `ServingEngine`'s (max_bytes, block_size, prefix_sharing, max_batched_tokens, ...); each
    manager the model creates builds its engine with them. For Redis, ``redis_url="redis://host:port/0"`` instead of
    ``remote=``: each engine opens a `RedisTier` of its own on it (an engine closes its tier when it stops).
    """
    if "remote" in engine_args:
        raise ValueError(
            "install() builds an engine for each batching manager, and an engine closes its tier when it stops, so "
            "it takes redis_url='redis://host:port/0' (a RedisTier per engine) instead of remote=."
        )
    if GenerationOutput is None or not hasattr(model, "generate_batch"):
        raise RuntimeError(
            f"transformers {TRANSFORMERS_VERSION} has no continuous batching API to install into (it needs "
            "transformers >= 5.0 and a model with generate_batch)."
        )
    checked = {k: v for k, v in engine_args.items() if k != "redis_url"}  # no Redis connection for the check
    _build_engine(model, checked).close()  # refuses a bad argument now, not at the first generate_batch
    setattr(model, _INSTALLED, dict(engine_args))
    model.init_continuous_batching = types.MethodType(_init_governed_batching, model)


def uninstall(model: Any) -> None:
    """Give `model` transformers' own continuous batching back."""
    if hasattr(model, _INSTALLED):
        delattr(model, _INSTALLED)
        del model.init_continuous_batching


# Generation settings that change which tokens come out and that the engine does not apply (beams are refused).
UNAPPLIED_SETTINGS = (
    "no_repeat_ngram_size", "bad_words_ids", "force_words_ids", "sequence_bias", "typical_p", "min_p",
    "epsilon_cutoff", "eta_cutoff", "top_h", "min_length", "renormalize_logits", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
    "stop_strings", "penalty_alpha", "guidance_scale", "watermarking_config", "encoder_repetition_penalty",
    "encoder_no_repeat_ngram_size", "dola_layers", "constraints",
)  # fmt: skip


def unapplied_settings(generation_config: Any) -> dict[str, Any]:
    """The settings of `generation_config` that would change the tokens and that the engine does not apply: those of
    `UNAPPLIED_SETTINGS` set to other than transformers' default."""
    from transformers import GenerationConfig

    default = GenerationConfig()
    unapplied = {}
    for name in UNAPPLIED_SETTINGS:
        value = getattr(generation_config, name, None)
        if value is not None and value != getattr(default, name, None):
            unapplied[name] = value
    return unapplied


def _init_governed_batching(
    model: Any, generation_config: Any = None, continuous_batching_config: Any = None, workload_hints: Any = None
) -> GovernedBatchingManager:
    """What `install` puts in place of `model.init_continuous_batching` (its signature)."""
    config = generation_config if generation_config is not None else model.generation_config
    return GovernedBatchingManager(model, config, **getattr(model, _INSTALLED))


class _EngineState:
    """The engine as transformers' server reads a batch processor: ``cache.compute_free_capacity()`` (the share of
    the byte cap, or without one of the pool's memory, not in use) and ``scheduler.active_requests`` /
    ``waiting_requests``."""

    def __init__(self, engine: ServingEngine) -> None:
        self._engine = engine
        self.cache = self
        self.scheduler = self

    def compute_free_capacity(self) -> float:
        stats = self._engine.stats()
        room = stats.kv_bytes_cap if stats.kv_bytes_cap is not None else stats.kv_bytes_held
        return 1.0 - stats.kv_bytes_used / room if room else 1.0

    @property
    def active_requests(self) -> list[Any]:
        return list(self._engine.scheduler.running)

    @property
    def waiting_requests(self) -> list[Any]:
        return list(self._engine.scheduler.waiting)


def _build_engine(model: Any, engine_args: dict[str, Any]) -> ServingEngine:
    """A `ServingEngine` with `engine_args`, ``redis_url`` opened as a `RedisTier` of its own."""
    args = dict(engine_args)
    redis_url = args.pop("redis_url", None)
    if redis_url is not None:
        from hf_kvgov.tiers.redis_tier import RedisTier

        args["remote"] = RedisTier(redis_url, model)
    return ServingEngine(model, **args)


class GovernedBatchingManager:
    """transformers' `ContinuousBatchingManager` interface on a `ServingEngine`: add requests, get results (all,
    or one request's as they stream), cancel, start and stop the background loop."""

    warmed_up = True  # nothing to capture: no CUDA graphs
    logit_processor = _SamplingKeys()

    def __init__(self, model: Any, generation_config: Any, **engine_args: Any) -> None:
        if (getattr(generation_config, "num_beams", None) or 1) > 1:
            raise ValueError(
                f"num_beams={generation_config.num_beams}: beam search is not continuous batching; the governed "
                "engine samples or decodes greedily (give num_beams=1, or run beams through model.generate)."
            )
        unapplied = unapplied_settings(generation_config)
        if unapplied:
            logger.warning(
                "kvgov: the governed engine does not apply %s from the generation config (it applies max_new_tokens, "
                "min_new_tokens, eos_token_id, do_sample, temperature, top_k, top_p, repetition_penalty and "
                "num_return_sequences); they are dropped, as transformers' continuous batching drops the logits "
                "processors it does not support.",
                ", ".join(f"{name}={value!r}" for name, value in unapplied.items()),
            )
        self.model = model
        self.generation_config = generation_config
        self.num_return_sequences = int(getattr(generation_config, "num_return_sequences", None) or 1)
        self._engine_args = engine_args
        self._engine: ServingEngine | None = None
        self._loop: EngineLoop | None = None
        self._outputs: queue.Queue[Any] = queue.Queue()
        self._states: dict[int, Any] = {}  # engine id -> the GenerationOutput transformers' callers see
        self._ids: dict[str, int] = {}
        self._streaming: set[int] = set()
        self._timestamps: set[int] = set()
        self._lock = threading.Lock()
        self._counter = 0
        self.background_thread_status = _LoopStatus()

    # ------------------------------------------------------------------ the loop

    def warmup(self) -> None:
        """Nothing to warm up (kept for transformers' context manager)."""

    def start(self) -> None:
        if self._loop is None:
            self._engine = _build_engine(self.model, self._engine_args)
            self._loop = EngineLoop(self._engine, listener=self._on_event)

    def is_running(self) -> bool:
        return self._loop is not None

    @property
    def batch_processor(self) -> _EngineState | None:
        """What transformers' server reads of its batch processor for its stats line (requests running and waiting,
        how full the KV pool is), from the engine; None before it starts, as the server expects."""
        return None if self._engine is None else _EngineState(self._engine)

    @property
    def engine(self) -> ServingEngine | None:
        """The engine behind the manager while it runs (its pool, prefix tree and stats), else None."""
        return self._engine

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False) -> None:
        """Stop the loop (what is still running is cancelled) and close the engine, giving the model its attention
        back."""
        if self._loop is not None and self._engine is not None:
            self._loop.stop()
            self._engine.close()
        self._loop = self._engine = None

    def destroy(self) -> None:
        self.stop()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        input_ids: Sequence[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str:
        if self._loop is None:
            raise RuntimeError("Start the manager (or use it as transformers' context manager) before adding requests.")
        sampling = {
            k: logit_processor_kwargs.pop(k) for k in ("temperature", "top_p", "top_k") if k in logit_processor_kwargs
        }
        if logit_processor_kwargs:
            raise ValueError(
                f"Per-request logits processor arguments {sorted(logit_processor_kwargs)} are not supported by the "
                "governed engine; it takes temperature, top_p, top_k, max_new_tokens and eos_token_id."
            )
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1).tolist()
        params = self._params(len(input_ids), max_new_tokens, eos_token_id, **sampling)
        with self._lock:
            if request_id is None:
                request_id = f"req_{self._counter}"
                self._counter += 1
            # num_return_sequences: the request and its children, named as transformers names them (each samples
            # with its own generator; with prefix sharing their shared prompt is computed once)
            children = [f"{request_id}__child#{i}" for i in range(self.num_return_sequences - 1)]
            for name in [*children, request_id]:
                state = GenerationOutput(request_id=name, prompt_ids=list(input_ids), status=RequestStatus.PENDING)
                state.timestamps = [] if record_timestamps else None
                stream = self._loop.submit(input_ids, params)
                engine_id = stream.request_id
                self._states[engine_id] = state
                self._ids[name] = engine_id
                if streaming:
                    self._streaming.add(engine_id)
        return request_id

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """`add_request` for each input; one the engine refuses (longer than the pool, a token the model does not
        have) comes back FAILED with the reason, as transformers fails a request, and the others run."""
        request_ids = []
        for ids in inputs:
            with self._lock:
                request_id = f"req_{self._counter}"
                self._counter += 1
            try:
                self.add_request(
                    ids, request_id, max_new_tokens, streaming, record_timestamps, **logit_processor_kwargs
                )
            except ValueError as refused:
                self._failed(request_id, ids, refused)
            request_ids.append(request_id)
        return request_ids

    def _failed(self, request_id: str, input_ids: Sequence[int], refused: ValueError) -> None:
        """Results FAILED with `refused` as the error for the request and its children."""
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1).tolist()
        for name in [*(f"{request_id}__child#{i}" for i in range(self.num_return_sequences - 1)), request_id]:
            state = GenerationOutput(request_id=name, prompt_ids=list(input_ids), status=RequestStatus.FAILED)
            state.error = str(refused)
            self._outputs.put(state)

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its blocks go back to the pool before the next step (logged at info with the pool's
        blocks then in use)."""
        engine_id = self._ids.get(request_id)
        if engine_id is not None and self._loop is not None and self._engine is not None:
            self._loop.cancel(engine_id)
            stats = self._engine.stats()
            logger.info(
                "kvgov: request %s cancelled; KV bytes in use %d of %s, requests running %d, waiting %d",
                request_id,
                stats.kv_bytes_used,
                stats.kv_bytes_cap,
                stats.running,
                stats.waiting,
            )

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> Any:
        """The next result (a finished request's, or a streaming request's latest state), or None after `timeout`."""
        if self._outputs.empty() and self._loop is None:
            return None
        try:
            result = self._outputs.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self._outputs.put(result)
            return None
        return result

    def request_id_iter(self, request_id: str) -> Iterator[Any]:
        """A request's results as they come, until it finished."""
        while True:
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return
            elif request_id not in self._ids:
                return

    # ------------------------------------------------------------------ results

    def _params(
        self,
        prompt_length: int,
        max_new_tokens: int | None,
        eos_token_id: int | list[int] | None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> SamplingParams:
        """A request's settings: what it was given, else the generation config's (greedy unless it samples), with
        what `model.generate` takes where the config is silent: ``max_length`` counts the prompt, and the end tokens
        are the model's own generation config's."""
        config = self.generation_config
        new = max_new_tokens if max_new_tokens is not None else config.max_new_tokens
        if new is None and config.max_length is not None:
            new = max(1, int(config.max_length) - prompt_length)
        eos = eos_token_id if eos_token_id is not None else config.eos_token_id
        if eos is None:
            eos = getattr(self.model.generation_config, "eos_token_id", None)
        stop = tuple(t for t in (eos if isinstance(eos, list) else [eos]) if t is not None and t >= 0)
        sampling = bool(config.do_sample)
        if temperature is None:
            temperature = float(config.temperature or 1.0) if sampling else 0.0
        if top_p is None:
            top_p = float(config.top_p or 1.0) if sampling else 1.0
        if top_k is None:
            top_k = int(config.top_k or 0) if sampling else 0
        max_new = int(new) if new is not None else 20  # transformers' default max_length - prompt
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            stop_token_ids=stop,
            min_new_tokens=min(int(config.min_new_tokens or 0), max_new),
            repetition_penalty=float(config.repetition_penalty or 1.0),
        )

    def _on_event(self, event: TokenEvent | BaseException) -> None:
        """The loop's listener: fold a token into its request's GenerationOutput and hand that out."""
        if isinstance(event, BaseException):
            self.background_thread_status.fatal_error = event
            for state in self._states.values():
                state.status, state.error = RequestStatus.FAILED, repr(event)
                self._outputs.put(state)
            return
        with self._lock:
            state = self._states.get(event.request_id)
        if state is None:
            return
        if event.token is not None:
            state.generated_tokens.append(event.token)
            if state.timestamps is not None:
                state.timestamps.append(time.perf_counter())
            state.status = RequestStatus.DECODING
        if event.finished:
            state.status = RequestStatus.FINISHED
            with self._lock:
                self._states.pop(event.request_id, None)
                self._ids.pop(state.request_id, None)
                self._streaming.discard(event.request_id)
            self._outputs.put(state)
        elif event.request_id in self._streaming:
            self._outputs.put(_snapshot(state))  # the state goes on growing while the consumer reads this one


def _snapshot(state: GenerationOutput) -> GenerationOutput:
    """A copy of a request's output as it stands, as transformers' own manager hands out each streamed result."""
    timestamps = None if state.timestamps is None else list(state.timestamps)
    return dataclasses.replace(
        state, generated_tokens=list(state.generated_tokens), logprobs=list(state.logprobs), timestamps=timestamps
    )
