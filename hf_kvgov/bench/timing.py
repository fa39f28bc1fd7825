"""Timing shared by the benchmarks: interleaved rounds, a clock on generated tokens, the machine's name.

Shared machines are noisy: another job starting halfway through a run slows whatever runs next. Every
benchmark therefore measures its configurations in interleaved rounds (each configuration once per round)
and reports medians, so a drift in load hits every configuration alike and ratios measured in one run
stay meaningful even when absolute figures do not.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from transformers.generation.streamers import BaseStreamer

T = TypeVar("T")


def interleaved(names: Sequence[str], rounds: int, measure: Callable[[str], T]) -> dict[str, list[T]]:
    """`measure(name)` for every name, once per round, names in the given order within a round.

    Returns:
        name -> its `rounds` samples, in the order they were taken.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(
            f"rounds must be a positive int (each configuration is measured once per round); got {rounds!r}."
        )
    samples: dict[str, list[T]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            samples[name].append(measure(name))
    return samples


def machine_description() -> str:
    """'x86_64, 2 threads, torch 2.13.0+cpu': what every recorded result names as its machine."""
    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


class TokenClock(BaseStreamer):
    """A generate streamer that records when each new token reaches the host.

    generate calls `put` with the prompt first, then once per step with that step's tokens (one per row).
    The tokens are copied to the CPU before `put`, which waits for the device: on CUDA the timestamps
    are the real completion times, not kernel launch times.
    """

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.token_times: list[float] = []
        self._prompt_seen = False

    def start(self) -> None:
        """Mark the moment generate is called (time to first token is measured from here)."""
        self.started_at = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.token_times.append(time.perf_counter())

    def end(self) -> None:
        """generate's end-of-stream call; nothing is buffered, so there is nothing to flush."""

    def elapsed_s(self) -> float:
        """Seconds since `start()`."""
        if self.started_at is None:
            raise RuntimeError("TokenClock.start() was never called, so no time has been measured from it.")
        return time.perf_counter() - self.started_at

    @property
    def first_token_s(self) -> float:
        """Seconds from `start()` to the first new token: prefill plus choosing that token."""
        if self.started_at is None or not self.token_times:
            raise RuntimeError("TokenClock saw no new token: call start() before generate and generate >= 1 token.")
        return self.token_times[0] - self.started_at

    @property
    def per_output_token_s(self) -> float:
        """Mean seconds between consecutive new tokens (decode steps); needs at least two tokens."""
        if len(self.token_times) < 2:
            raise RuntimeError(
                f"Time per output token needs at least 2 new tokens; the clock saw {len(self.token_times)}."
            )
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)
