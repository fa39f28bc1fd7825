"""The notebooks in examples/ run unchanged on the CPU, every cell, and end with a plot or a table.

Each notebook runs in a fresh `python3` kernel (nbclient) whose working directory is a temporary folder, so
nothing is written into the repository; kernels run side by side, one per core (up to three). Each inherits
three settings from the test:

- CUDA is hidden, so a CI machine with a GPU still runs the notebooks at their CPU sizes;
- one intra-op thread: on a small CI machine shared with other jobs, torch's default of one thread per core
  oversubscribes the cores and decodes several times slower;
- matplotlib's inline backend, so that a CI-wide `MPLBACKEND=Agg` does not swallow the figures.

The notebooks load the embedded SmolLM2; like every real-model test they need it fetched beforehand
(`kvgov fetch`): a test never downloads.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from hf_kvgov import models

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = (
    "01_quickstart",
    "02_multi_turn_chat",
    "03_quantization_check",
    "04_streaming_sink",
    "05_capacity_planner",
)
CELL_TIMEOUT_S = 300  # a cell stuck this long is a hang, not a slow machine
PARALLEL_KERNELS = max(1, min(3, os.cpu_count() or 1))  # one core each; each holds ~1.5 GB (torch + the model)
KERNEL_ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
DEVICE_LINE = 'device = "cuda" if torch.cuda.is_available() else "cpu"'

# Text every executed notebook must show, worked out by hand from the model geometries, not read from the code:
# SmolLM2-135M's full KV per token is 2 (K, V) x 30 layers x 3 KV heads x 64 x 4 B (float32) = 46,080 B;
# LLaMA-13B's in fp16 is 2 x 40 x 40 x 128 x 2 B = 819,200 B, and 819,200 x 2,048 = 1,677,721,600 B per user.
EXPECTED_TEXT: dict[str, tuple[str, ...]] = {
    "01_quickstart": ("| 46,080 |", "| paged |", "| int8 |", "| h2o |", "| sink |", "| disk |"),
    "02_multi_turn_chat": ("| 1 | ", "| 2 | ", "| 3 | ", "prompt tokens served from cache"),
    "03_quantization_check": ("| int8 |", "| fp8 |", "| int4 |", "Recommended: `"),
    "04_streaming_sink": ("| sink 4 + 60 |", "no sinks", "full (DynamicCache)", "KV held at the end"),
    "05_capacity_planner": (
        "819,200 B",
        "1,677,721,600 B",
        "does NOT hold",
        "| int8 |",
        "| + H2O 20% | HeavyHitterCache: int8 -> H2O 20% |",
        "| + disk spill | HeavyHitterCache: int8 -> H2O 20% -> disk spill with recall (8 pages of 16 tokens per "
        "step, one buffer the layers share) |",
    ),
}


def notebook_path(name: str) -> Path:
    return EXAMPLES / f"{name}.ipynb"


def read(name: str) -> Any:
    return nbformat.read(notebook_path(name), as_version=4)


def code_cells(notebook: Any) -> list[Any]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def shown_text(cell: Any) -> str:
    """Everything a cell printed or displayed as text (streams, markdown, plain reprs)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        for kind in ("text/markdown", "text/plain"):
            parts.append(output.get("data", {}).get(kind, ""))
    return "\n".join(parts)


def shows_plot_or_table(cell: Any) -> bool:
    data = [output.get("data", {}) for output in cell.get("outputs", [])]
    return any("image/png" in d or "|---" in d.get("text/markdown", "") for d in data)


def test_examples_holds_exactly_the_five_notebooks() -> None:
    assert sorted(path.stem for path in EXAMPLES.glob("*.ipynb")) == list(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_valid_and_has_no_outputs(name: str) -> None:
    notebook = read(name)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    for cell in code_cells(notebook):
        assert cell.outputs == [] and cell.execution_count is None, f"{name}: commit notebooks without outputs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_with_a_guarded_install_and_picks_its_device(name: str) -> None:
    notebook = read(name)
    first = notebook.cells[0]
    assert first.cell_type == "code"
    lines = first.source.splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith("if importlib.util.find_spec("))
    assert '"hf_kvgov"' in lines[guard]
    install = next(i for i, line in enumerate(lines) if "%pip install" in line)
    assert install > guard and lines[install].startswith("    "), "the install must only run inside the guard"
    assert any(DEVICE_LINE in cell.source for cell in code_cells(notebook))
    assert notebook.cells[-1].cell_type == "code", "the last cell must draw the plot or table"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_passes_the_cache_by_its_current_name(name: str) -> None:
    """transformers 5.24 warns on `past_key_values=` (renamed `cache=`); a notebook must not need to hide that."""
    for cell in code_cells(read(name)):
        assert "past_key_values" not in cell.source, f"{name}: pass the cache as cache=, not past_key_values="
        assert "filterwarnings" not in cell.source, f"{name}: a notebook should be quiet without silencing warnings"


@dataclass(frozen=True)
class Run:
    """One notebook executed: the notebook with its outputs, the wall time, and the error that stopped it."""

    notebook: Any
    seconds: float
    error: BaseException | None


async def execute(name: str, folder: Path, gate: asyncio.Semaphore) -> tuple[str, Run]:
    async with gate:
        notebook = read(name)
        client = NotebookClient(
            notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        )
        start = time.perf_counter()
        try:
            await client.async_execute()
        except Exception as error:  # a failing cell, a dead kernel, a timeout: that notebook's test reports it
            return name, Run(notebook, time.perf_counter() - start, error)
        return name, Run(notebook, time.perf_counter() - start, None)


async def execute_all(folders: dict[str, Path]) -> dict[str, Run]:
    gate = asyncio.Semaphore(PARALLEL_KERNELS)
    return dict(await asyncio.gather(*(execute(name, folder, gate) for name, folder in folders.items())))


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every notebook, executed once, `PARALLEL_KERNELS` at a time (each kernel computes on one thread)."""
    if not models.is_fetched("smollm2"):
        pytest.fail("The embedded model 'smollm2' is not fetched; run `kvgov fetch` before the tests (no downloads).")
    folders = {name: tmp_path_factory.mktemp(name) for name in NOTEBOOKS}
    before = sorted(EXAMPLES.rglob("*"))
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in KERNEL_ENV.items():
            patch.setenv(key, value)
        runs = asyncio.run(execute_all(folders))
    times = ", ".join(f"{name} {run.seconds:.0f} s" for name, run in runs.items())
    print(f"\nnotebooks executed in {time.perf_counter() - start:.0f} s ({times})")
    assert sorted(EXAMPLES.rglob("*")) == before, "a notebook wrote into examples/"
    return runs


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_on_the_cpu(name: str, executed: dict[str, Run]) -> None:
    run = executed[name]
    if run.error is not None:
        pytest.fail(f"{name} stopped after {run.seconds:.0f} s: {run.error}")
    notebook = run.notebook
    assert not [cell for cell in code_cells(notebook) if any(o.output_type == "error" for o in cell.outputs)]
    assert shows_plot_or_table(notebook.cells[-1]), f"{name}: the last cell shows neither a plot nor a table"
    text = "\n".join(shown_text(cell) for cell in code_cells(notebook))
    missing = [expected for expected in EXPECTED_TEXT[name] if expected not in text]
    assert not missing, f"{name}: the outputs lack {missing}"
    stderr = "\n".join(o.text for cell in code_cells(notebook) for o in cell.outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "deprecated" not in stderr, f"{name} printed warnings:\n{stderr}"
