"""What `kvgov check-quant` computes by default and with --full, counted before it runs and checked against what
runs; its one progress bar; its thread count."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest
import torch
from tqdm import tqdm

from hf_kvgov.cli import check_quant
from hf_kvgov.quality import lockstep
from hf_kvgov.quality.check import QUICK, CheckOptions, ScanWhen, check_quantization
from hf_kvgov.quality.plan import cost, row_tokens
from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_llama

SMOLLM2_LAYERS = 30
TEXT = "It is a truth universally acknowledged, that a single man must be in want of a wife. " * 3


def cli_options(argv: list[str]) -> CheckOptions:
    parser = argparse.ArgumentParser(prog="kvgov")
    check_quant.add_parser(parser.add_subparsers(dest="command"))
    return check_quant.options_from_args(parser.parse_args(["check-quant", *argv]))


def test_the_default_is_one_pass_over_every_token_and_gates_at_half_a_percent() -> None:
    options = cli_options([])
    plan = options.plan(2048, SMOLLM2_LAYERS)
    # Every token a block per step, as in generation: fp8 costs SmolLM2 +0.17% over the first 1,024 tokens of the
    # built-in text and +0.69% over 2,048, so a shorter default would pass what the 0.5% gate must fail.
    assert (options.max_tokens, options.chunk, options.max_ppl_increase) == (2048, 16, 0.5)
    assert [(p.rows, p.tokens) for p in plan.certain] == [(4, 2048)]  # the reference and 3 formats, once
    assert row_tokens(plan.certain) == 4 * 2047
    # A failing lowest-bit format adds the scan (30 layers + the reference, one pass) and one retry.
    assert [(p.rows, p.tokens) for p in plan.worst_case] == [(4, 2048), (31, 512), (2, 2048)]
    assert row_tokens(plan.worst_case) == 4 * 2047 + 31 * 511 + 2 * 2047


def test_full_scans_every_layer_whatever_the_verdict() -> None:
    full = cli_options(["--full"])
    assert full.scan == "always" and cli_options([]).scan == "if-failing" and cli_options(["--no-scan"]).scan == "never"
    plan = full.plan(2048, SMOLLM2_LAYERS)
    assert [(p.rows, p.tokens) for p in plan.certain] == [(4, 2048), (31, 512)]
    assert cost(plan.certain) > 1.5 * cost(QUICK.plan(2048, SMOLLM2_LAYERS).certain)
    smaller = cli_options(["--full", "--scan-tokens", "128", "--rows", "8"]).plan(2048, SMOLLM2_LAYERS)
    assert [(p.rows, p.tokens) for p in smaller.scan] == [(9, 128), (9, 128), (9, 128), (7, 128)]
    with pytest.raises(SystemExit):
        cli_options(["--full", "--no-scan"])


def test_help_says_how_long_the_default_and_the_full_scan_take() -> None:
    subparsers = argparse.ArgumentParser(prog="kvgov").add_subparsers(dest="command")
    check_quant.add_parser(subparsers)
    shown = subparsers.choices["check-quant"].format_help()
    default = next(line for line in shown.splitlines() if line.startswith("  default "))
    full = next(line for line in shown.splitlines() if line.startswith("  --full "))
    assert re.search(r"\d+ s\b", shown.split(default)[1].split(full)[0]) and re.search(r"\d+ s\b", full)


class ForwardCounter:
    """Counts the row-tokens that go through `model`'s forward."""

    def __init__(self, model: Any) -> None:
        self.row_tokens = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"]
        self.row_tokens += int(ids.shape[0] * ids.shape[1])


@pytest.mark.parametrize(
    ("scan", "gate", "ran"),
    [
        ("if-failing", 1000.0, "certain"),  # every format passes: no scan, no retry
        ("if-failing", 0.0, "worst_case"),  # int4 fails a 0% gate (+0.025%): the scan, then the retry
        ("always", 1000.0, "certain"),
        ("never", 0.0, "certain"),  # no scan to pick layers from, no outlier layer: no retry
    ],
)
def test_what_runs_is_what_the_plan_counted(scan: ScanWhen, gate: float, ran: str) -> None:
    model = tiny_llama()
    counter = ForwardCounter(model)
    options = CheckOptions(max_tokens=160, block_size=8, scan_tokens=40, max_ppl_increase=gate, scan=scan)
    report = check_quantization(model, char_tokenizer(), TEXT, options)
    assert (report.sensitivity is not None) == (scan == "always" or ran == "worst_case")
    assert counter.row_tokens == row_tokens(getattr(options.plan(report.tokens, 2), ran))


def test_one_progress_bar_covers_the_whole_check(monkeypatch: pytest.MonkeyPatch) -> None:
    bars: list[tqdm] = []

    class Recorded(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(lockstep, "tqdm", Recorded)
    options = CheckOptions(max_tokens=160, block_size=8, scan_tokens=40, max_ppl_increase=0.0, scan="if-failing")
    check_quantization(tiny_llama(), char_tokenizer(), TEXT, options, progress=True)
    (bar,) = bars  # one bar, not one per pass
    # Its total grew by the scan and the retry once the format failed, and the check ran to that total.
    assert bar.total == pytest.approx(cost(options.plan(160, 2).worst_case))
    assert bar.n == pytest.approx(bar.total) and "{remaining}" in bar.bar_format


def test_threads_default_to_the_idle_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check_quant.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(check_quant.os, "getloadavg", lambda: (1.4, 2.0, 2.0))
    assert check_quant.idle_cores() == 1  # another job holds a core: two threads would stall each other
    monkeypatch.setattr(check_quant.os, "getloadavg", lambda: (0.2, 0.1, 0.0))
    assert check_quant.idle_cores() == 2
    monkeypatch.setattr(check_quant.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert check_quant.idle_cores() == 1
    before = torch.get_num_threads()
    with check_quant.torch_threads(1) as threads:
        assert threads == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before  # a run leaves the process's setting as it found it
