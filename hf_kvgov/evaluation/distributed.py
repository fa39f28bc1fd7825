"""Data-parallel evaluation: each process runs a share of the examples, the main process reports.

Run any `kvgov eval` command under ``accelerate launch --multi_gpu --num_processes N`` (or ``torchrun
--nproc_per_node N``): every process loads the model, runs ``workers.share(items)``, and
``workers.gather(results)`` hands every process all results in one list. On a single process both are
the identity, so the same code runs unchanged without a launcher. On Ctrl-C each process keeps only
what it finished itself (see `hf_kvgov.partial`): the main process reports its own rows.

On a machine without CUDA the process group is built on CPU (gloo): accelerate only does that when
asked for CPU, so `Workers` asks whenever CUDA is absent. (``accelerate launch --cpu`` itself starts a
single process unless it is given an MPI hostfile; ``--multi_gpu`` starts N processes through torchrun.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from hf_kvgov.partial import Interrupted, Progress, on_interrupt

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Workers:
    """This process's place among the evaluation processes."""

    index: int  # 0 .. count - 1; 0 is the main process
    count: int
    device: torch.device

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(
                f"A process index must lie in [0, count) with count >= 1; got {self.index} of {self.count}."
            )

    @property
    def is_main(self) -> bool:
        """Only the main process prints and writes files."""
        return self.index == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's items: every `count`-th one from `index`, so long and short items spread evenly."""
        return list(items[self.index :: self.count])

    def gather(self, results: list[T]) -> list[T]:
        """All processes' results concatenated in process order (every process gets the whole list)."""
        if self.count == 1:
            return list(results)
        from accelerate.utils import gather_object

        gathered: list[T] = gather_object(results)
        return gathered

    def map(
        self,
        items: Sequence[T],
        run: Callable[[T], list[R]],
        desc: str,
        partial: Callable[[list[R]], Any] | None = None,
    ) -> list[R]:
        """Run this process's share of ``items`` (a progress bar on the main process) and gather every result.

        On Ctrl-C: raises `Interrupted` holding ``partial(results of this process's finished items)``, the
        report of what this process finished (None without ``partial``); nothing is gathered.
        """
        mine: list[R] = []
        done = 0

        def interrupted() -> Interrupted:
            report = partial(mine) if partial is not None and done else None
            return Interrupted(report, Progress(done, len(items), "samples", self.count))

        with on_interrupt(interrupted):
            for item in tqdm(self.share(items), desc=desc, unit="example", disable=not self.is_main):
                mine += run(item)
                done += 1
            return self.gather(mine)

    def finish(self, completed: bool) -> None:
        """Leave the process group at the end of a run; a no-op on a single process.

        A process group left for the interpreter's exit to tear down can abort a process whose peer has
        already gone (gloo raises on a closed connection from a background thread), turning a finished run
        into a non-zero exit. So every process waits for the others at a barrier (only after ``completed``
        work: a process that failed may have peers that never reach it) and then destroys the group itself.
        """
        if self.count == 1 or not torch.distributed.is_initialized():
            return
        if completed:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def single_process() -> Workers:
    """The workers of a run without a launcher."""
    return Workers(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def current_workers() -> Workers:
    """The workers of this run: from accelerate's `PartialState` when a launcher started several processes."""
    from accelerate import PartialState

    state: Any = PartialState(cpu=not torch.cuda.is_available())
    return Workers(int(state.process_index), int(state.num_processes), torch.device(state.device))
