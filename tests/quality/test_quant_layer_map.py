"""`kvgov check-quant --recommend`: a format per layer for a perplexity budget.

The choice rule on hand-made scans (exact formats), then the whole command on the tiny model saved as a
local directory: the map it writes loads into a cache, and its measured loss is the one the file reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_quant_check_cli import kvgov

from hf_kvgov import QuantConfig
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality.check import CheckOptions
from hf_kvgov.quality.layer_map import _search, choose_layer_formats, passage_ids
from hf_kvgov.quality.lockstep import CacheScore, LockstepResult
from tests.conftest import tiny_llama

COSTS = {"int2": 1.0, "int4": 2.0, "int8": 4.0, "full": 8.0}


def test_every_layer_stays_cheapest_when_the_sum_fits() -> None:
    scan = {"int2": [0.1, 0.2, 0.1], "int4": [0.0, 0.0, 0.0], "int8": [0.0, 0.0, 0.0]}
    assert choose_layer_formats(scan, COSTS, target_pct=0.5) == ("int2", "int2", "int2")


def test_the_upgrade_that_saves_most_per_byte_goes_first() -> None:
    # int2 sum 2.2 > 1.0. Layer 1: int2 -> int4 saves 1.5 for 1 byte; layer 0: saves 0.4 for 1 byte.
    # After layer 1's upgrade the sum is 0.7 <= 1.0.
    scan = {"int2": [0.5, 1.6, 0.1], "int4": [0.1, 0.1, 0.0], "int8": [0.0, 0.0, 0.0]}
    assert choose_layer_formats(scan, COSTS, target_pct=1.0) == ("int2", "int4", "int2")
    # A target of 0.2: then layer 0 to int4 (0.4 per byte; sum 0.3), then layer 2 to int4 (0.1 per byte, ahead of
    # 0.05 per byte for either int8): sum 0.2, within the target.
    assert choose_layer_formats(scan, COSTS, target_pct=0.2) == ("int4", "int4", "int4")


def test_a_zero_budget_keeps_every_lossy_layer_lossless() -> None:
    scan = {"int2": [0.3, -0.1], "int4": [0.1, -0.2], "int8": [0.05, 0.0]}
    # Layer 1 never loses (negative increases count as 0); layer 0 must reach full precision.
    assert choose_layer_formats(scan, COSTS, target_pct=0.0) == ("full", "int2")


def test_scans_of_different_lengths_and_a_missing_full_are_refused() -> None:
    with pytest.raises(ValueError, match="same layers"):
        choose_layer_formats({"int2": [0.1], "int4": [0.1, 0.2]}, COSTS, 0.5)
    with pytest.raises(ValueError, match="must include 'full'"):
        choose_layer_formats({"int2": [0.1]}, {"int2": 1.0}, 0.5)


@pytest.mark.parametrize("budget", ["1000", "0"])
def test_the_command_writes_a_map_the_cache_loads(tiny_dir: Path, tmp_path: Path, budget: str) -> None:
    out = tmp_path / "map.json"
    argv = ["--model", str(tiny_dir), "--text", str(tiny_dir / "text.txt"), "--tokens", "120", "--block-size", "8"]
    argv += [
        "--scan-tokens",
        "48",
        "--formats",
        "int8,int4,int2",
        "--max-ppl-increase",
        budget,
        "--recommend",
        str(out),
    ]
    status = kvgov(argv)
    saved = json.loads(out.read_text())
    assert status == (0 if saved["met"] else 1)
    config = QuantConfig.load(out)
    formats = saved["formats"]
    assert len(formats) == 2 and set(formats) <= {"int8", "int4", "int2", "full"}
    if budget == "1000":
        assert formats == ["int2", "int2"] and saved["met"]  # everything fits: the cheapest everywhere
    else:  # a map is only ever handed over as meeting the budget when its measured loss does
        assert saved["met"] == (saved["measured"]["ppl_increase_pct"] <= 0)
    if saved["met"] and saved["int8"]["ppl_increase_pct"] <= float(budget):
        assert saved["bytes_per_token"] <= saved["int8"]["bytes_per_token"]  # uniform int8 is a candidate
    cache = QuantizedCache.from_config(tiny_llama(), out, block_size=8)
    assert cache.quant == config
    with torch.inference_mode():
        tiny_llama()(torch.arange(3, 40)[None], cache=cache)
    assert cache.get_seq_length() == 37


def test_an_unwritable_map_path_is_refused_before_measuring(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a_file").write_text("not a directory\n")
    assert kvgov(["--model", str(tiny_dir), "--recommend", str(tmp_path / "a_file" / "map.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written: " in err and "is a file, not a directory" in err and err.count("\n") == 1, err
    assert kvgov(["--model", str(tiny_dir), "--recommend", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


class JointLoss:
    """Stands in for the measuring runner: a map's joint loss is 3x the sum of its layers' scan losses, times
    the passage's own factor (the ``ids`` it is given: a passage that costs quantization more)."""

    def __init__(self, scan: dict[str, list[float]]) -> None:
        self.scan, self.measured = scan, []

    def score(self, ids: float, configs: dict[str, QuantConfig], label: str) -> LockstepResult:
        config = configs["map"]
        loss = (
            ids
            * 3
            * sum(max(0.0, self.scan[config.layer_format(i)][i]) for i in range(3) if config.layer_format(i) != "full")
        )
        self.measured.append(loss)
        score = CacheScore("map", 10, 1.0 + loss / 100, 1.0, loss, 0.0, 1.0, 0.0, 1.0)
        return LockstepResult(scores={"map": score}, reference=None)  # type: ignore[arg-type]


def test_after_a_miss_the_target_shrinks_by_the_predictions_shortfall() -> None:
    scan = {"int2": [0.3, 0.3, 0.3], "int4": [0.1, 0.1, 0.1], "int8": [0.0, 0.0, 0.0]}
    runner = JointLoss(scan)
    options = CheckOptions(formats=("int2", "int4", "int8"))
    tried = _search(runner, [1.0], scan, COSTS, budget_pct=0.5, options=options)  # type: ignore[arg-type]
    # Round 1, target 0.25: int2 -> int4 on every layer (0.2 per byte), then layer 0 to int8 (0.05 per byte):
    # predicted 0.2, measured 0.6, a miss. The shortfall is 3x, so the target becomes min(0.25 / 2, 0.8 x 0.5 / 3)
    # = 0.125: layer 1 to int8 as well, predicted 0.1, measured 0.3, within the budget.
    assert [chosen for chosen, _, _ in tried] == [("int8", "int4", "int4"), ("int8", "int8", "int4")]
    assert [round(m, 9) for m in runner.measured] == [0.6, 0.3]


def test_on_two_passages_a_map_holds_only_when_it_holds_on_the_harder_one() -> None:
    scan = {"int2": [0.3, 0.3, 0.3], "int4": [0.1, 0.1, 0.1], "int8": [0.0, 0.0, 0.0]}
    options = CheckOptions(formats=("int2", "int4", "int8"))
    # The first map (predicted 0.2) measures 0.6 on the first passage and 1.2 on the second, which costs
    # quantization 2x as much. The worst passage sets the shortfall, 6x, so the target becomes
    # min(0.25 / 2, 0.8 x 0.5 / 6) = 0.067: every layer in int8 (on one passage the shortfall is 3x, the target
    # 0.125, and layer 2 stays in int4: the test above).
    runner = JointLoss(scan)
    tried = _search(runner, [1.0, 2.0], scan, COSTS, budget_pct=0.5, options=options)  # type: ignore[arg-type]
    assert [chosen for chosen, _, _ in tried] == [("int8", "int4", "int4"), ("int8", "int8", "int8")]
    assert [tuple(round(p, 9) for p in measured.pcts) for _, _, measured in tried] == [(0.6, 1.2), (0.0, 0.0)]
    assert [round(measured.worst.ppl_increase_pct, 9) for _, _, measured in tried] == [1.2, 0.0]


class CharTokenizer:
    """One token per character, as a tokenizer call returns it."""

    def __call__(self, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([[ord(c) for c in text]])}


def test_passages_are_consecutive_cuts_of_one_text_or_one_per_text() -> None:
    options = CheckOptions(max_tokens=40, block_size=8)
    text = "".join(chr(65 + i % 26) for i in range(130))
    cut = passage_ids(CharTokenizer(), text, 3, options)
    assert [ids.tolist()[0] for ids in cut] == [[ord(c) for c in text[i * 40 : (i + 1) * 40]] for i in range(3)]
    assert len(passage_ids(CharTokenizer(), text, 1, options)[0][0]) == 40  # one passage: the first 40 tokens
    listed = passage_ids(CharTokenizer(), [text[:50], text[60:]], 1, options)
    assert [ids.shape[1] for ids in listed] == [40, 40] and listed[1][0, 0] == ord(text[60])
    with pytest.raises(ValueError, match="4 passages of 40 tokens need 160 tokens of text; it has 130"):
        passage_ids(CharTokenizer(), text, 4, options)
    with pytest.raises(ValueError, match="not both"):
        passage_ids(CharTokenizer(), [text], 2, options)
    with pytest.raises(ValueError, match="passages must be an int >= 1; got 0"):
        passage_ids(CharTokenizer(), text, 0, options)


def test_the_command_chooses_on_two_passages_and_refuses_passages_it_cannot_cut(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "map.json"
    argv = ["--model", str(tiny_dir), "--text", str(tiny_dir / "text.txt"), "--tokens", "120", "--block-size", "8"]
    argv += ["--scan-tokens", "48", "--formats", "int8,int4", "--max-ppl-increase", "1000", "--recommend", str(out)]
    assert kvgov([*argv, "--passages", "2"]) == 0
    saved = json.loads(out.read_text())
    assert len(saved["measured"]["passages_pct"]) == 2 and len(saved["int8"]["passages_pct"]) == 2
    assert saved["measured"]["ppl_increase_pct"] == max(saved["measured"]["passages_pct"])
    assert "on the worst of 2 passages" in capsys.readouterr().out
    assert kvgov([*argv, "--passages", "6"]) == 2  # the text has 600 characters, 6 x 120 = 720 tokens
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading lines
    assert last.startswith("kvgov check-quant: error: 6 passages of 120 tokens need 720 tokens of text; it has 600")
    assert kvgov(["--model", str(tiny_dir), "--passages", "2"]) == 2
    assert "--passages applies to --recommend only" in capsys.readouterr().err
