"""`kvgov bench serve`: the trace, the metrics, every configuration on the tiny model, and the command line."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from hf_kvgov.bench.serve import Sample, ServeConfig, Served, run_serve, serve_markdown, summarize
from hf_kvgov.bench.serve_workload import TraceConfig, build_trace
from hf_kvgov.cli.main import main
from tests.bench.conftest import BYTES_PER_TOKEN
from tests.bench.test_bench_cli import _is_png


def test_trace_is_seeded_zipf_popular_and_poisson(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    config = TraceConfig(requests=400, rate=5.0, documents=4, document_tokens=20, seed=3)
    trace = build_trace(tokenizer, config)
    assert trace == build_trace(tokenizer, config)  # one seed, one trace
    assert build_trace(tokenizer, TraceConfig(requests=400, rate=5.0, documents=4, document_tokens=20, seed=4)) != trace
    counts = [sum(r.document == k for r in trace) for k in range(4)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[3]  # 1/k^1.2 popularity
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(trace)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.15)
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.2)  # exponential: the deviation is the mean
    same_document = [r.prompt for r in trace if r.document == 0]
    assert all(p[:20] == same_document[0][:20] for p in same_document)  # the shared prefix
    assert all(16 <= r.new_tokens <= 48 for r in trace)
    burst = build_trace(tokenizer, TraceConfig(requests=5, documents=2, document_tokens=20))
    assert [r.arrival for r in burst] == [0.0] * 5


def test_bad_settings_name_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        TraceConfig(rate=0)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        TraceConfig(min_new_tokens=9, max_new_tokens=4)
    with pytest.raises(ValueError, match="document_tokens must be at most 5125"):
        TraceConfig(document_tokens=6000)  # passages would overlap
    with pytest.raises(ValueError, match=r"Unknown serving configuration\(s\) \['vllm'\]"):
        ServeConfig(configs=("paged", "vllm"))


def test_metrics_from_known_times() -> None:
    """Two requests with hand-set times; the figures follow vLLM's definitions."""
    served = [
        Served(arrival=0.0, admitted=0.5, token_times=[1.0, 1.5, 2.0], tokens=[5, 6, 7]),
        Served(arrival=1.0, admitted=1.0, token_times=[4.0, 5.0], tokens=[8, 9]),
        Served(arrival=2.0, failed="refused"),
    ]
    samples = [Sample(1.0, 1, 100, 0), Sample(2.0, 3, 300, 2)]
    config = ServeConfig(slo_ttft_s=2.0, slo_tpot_s=0.6)
    row = summarize("x", served, samples, (1, 7, 0.25, 3), config)
    assert (row.completed, row.failed, row.duration_s) == (2, 1, 5.0)
    assert row.output_throughput == pytest.approx(5 / 5.0) and row.request_throughput == pytest.approx(2 / 5.0)
    assert row.ttft.mean == pytest.approx(2.0) and row.ttft.p50 == pytest.approx(2.0)  # 1.0 and 3.0
    assert row.tpot.mean == pytest.approx(0.75)  # 0.5 and 1.0
    assert row.itl.p99 == pytest.approx(0.5 + 0.98 * 0.5)  # 0.5, 0.5, 1.0: linear between the 2nd and 3rd
    assert row.e2e.mean == pytest.approx(3.0) and row.queue.mean == pytest.approx(0.25)
    assert row.goodput == pytest.approx(1 / 5.0)  # only the first meets both SLOs
    assert (row.running_max, row.running_mean, row.kv_bytes_max) == (3, 2.0, 300)
    assert (row.decoding_max, row.decoding_mean) == (2, 1.0)
    assert (row.preemptions, row.recomputed_tokens, row.prefix_hit_rate, row.swapped_blocks) == (1, 7, 0.25, 3)


def test_every_configuration_serves_the_burst_without_failures(tiny: tuple[Any, Any]) -> None:
    """A cap of about three requests' padded KV, eight requests at once: everything completes, lossless rows agree
    token for token, the engine stays under the cap, and prefix sharing hits."""
    model, tokenizer = tiny
    trace = TraceConfig(requests=8, documents=2, document_tokens=80, min_new_tokens=4, max_new_tokens=8)
    config = ServeConfig(trace=trace, kv_bytes=3 * 160 * BYTES_PER_TOKEN, block_size=4, max_batched_tokens=64)
    report = run_serve(model, tokenizer, config, "tiny", progress=False)
    rows = {row.config: row for row in report.rows}
    assert list(rows) == ["static", "transformers", "paged", "prefix", "int8", "h2o"]
    for row in rows.values():
        assert (row.completed, row.failed) == (8, 0), row.config
        assert row.kv_bytes_max <= config.kv_bytes, row.config
        assert row.ttft.p99 >= row.ttft.p50 > 0 and math.isfinite(row.output_throughput)
    assert rows["paged"].outputs == rows["prefix"].outputs == rows["transformers"].outputs
    # Agreement with the full cache (paged, the first lossless configuration): whole for the lossless ones.
    assert rows["paged"].agreement is None and rows["paged"].reference
    assert [row.config for row in rows.values() if row.reference] == ["paged"]
    table = serve_markdown(report)
    assert "| reference |" in table.splitlines()[[r.config for r in report.rows].index("paged") + 4]
    assert "nan" not in table  # transformers' manager gives no queue times: n/a
    assert rows["prefix"].agreement == rows["static"].exact_match == 1.0
    assert 0.0 <= rows["h2o"].exact_match <= rows["h2o"].agreement <= 1.0  # type: ignore[operator]
    asked = [r.new_tokens for r in build_trace(tokenizer, trace)]
    assert [len(o) for o in rows["paged"].outputs] == asked
    assert rows["prefix"].prefix_hit_rate > 0.4 and rows["paged"].prefix_hit_rate == 0
    assert rows["int8"].running_max >= rows["prefix"].running_max
    assert rows["transformers"].prefix_hit_rate is None and rows["static"].prefix_hit_rate == 0
    assert rows["static"].running_max <= 3  # its padded batches fit the cap
    # Decoding requests are counted alike: never more than the ones taken in, and each configuration decodes some.
    for row in rows.values():
        assert 1 <= row.decoding_max <= row.running_max, row.config
    assert rows["static"].decoding_max == rows["static"].running_max  # a static batch decodes all its rows
    data = report.to_dict()
    assert [r["config"] for r in data["rows"]] == list(rows) and "outputs" not in data["rows"][0]


def test_a_cap_that_forces_preemption_fails_nothing(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    trace = TraceConfig(requests=6, documents=3, document_tokens=8, min_new_tokens=40, max_new_tokens=48)
    config = ServeConfig(
        configs=("paged", "swap"), trace=trace, kv_bytes=40 * 4 * BYTES_PER_TOKEN, block_size=4, max_batched_tokens=64
    )
    row, swapping = run_serve(model, tokenizer, config, "tiny", progress=False).rows
    lengths = sorted((len(r.prompt), len(r.prompt) + r.new_tokens) for r in build_trace(tokenizer, trace))
    assert lengths[-1][1] <= 40 * 4 < lengths[0][1] + lengths[1][1]  # each fits alone, no two to the end
    assert (row.completed, row.failed) == (6, 0)
    assert row.preemptions > 0 and row.recomputed_tokens > 0 and row.swapped_blocks is None
    assert (swapping.completed, swapping.failed) == (6, 0)  # swapped to disk instead of computed again:
    assert swapping.preemptions and swapping.swapped_blocks and swapping.recomputed_tokens == 0


def test_command_line_writes_json_table_and_plots(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    argv = ["bench", "serve", "--model", str(tiny_dir), "--configs", "paged,prefix", "--requests", "4"]
    argv += ["--documents", "2", "--document-tokens", "24", "--new-tokens", "6", "--rate", "20", "--block-size", "4"]
    argv += ["--kv-budget", f"{400 * BYTES_PER_TOKEN}B", "--json", str(out), "--plots", str(plots)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| prefix | 4 | 0 |" in printed and f"Wrote {out}" in printed
    report = json.loads(out.read_text())
    assert report["config"]["trace"]["rate"] == 20.0 and [r["completed"] for r in report["rows"]] == [4, 4]
    assert _is_png(plots / "running.png") and _is_png(plots / "ttft_cdf.png")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--rate", "fast", "--rate takes requests per second"),
        ("--configs", "paged,vllm", "Unknown serving configuration"),
        ("--kv-budget", "lots", "KV byte cap"),
    ],
)
def test_bad_options_get_one_line(option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", option, value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_requests_larger_than_the_pool_are_counted_failed(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    trace = TraceConfig(requests=3, documents=1, document_tokens=60, min_new_tokens=4, max_new_tokens=4)
    config = ServeConfig(configs=("paged", "static"), trace=trace, kv_bytes=8 * 4 * BYTES_PER_TOKEN, block_size=4)
    for row in run_serve(model, tokenizer, config, "tiny", progress=False).rows:
        assert (row.completed, row.failed) == (0, 3), row.config


def test_streamed_h2o_serves_without_a_prefix_tree(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    trace = TraceConfig(requests=6, documents=6, document_tokens=80, min_new_tokens=4, max_new_tokens=8)
    config = ServeConfig(configs=("paged", "h2o-stream"), trace=trace, kv_bytes=2 * 100 * BYTES_PER_TOKEN, block_size=4)
    full, streamed = run_serve(model, tokenizer, config, "tiny", progress=False).rows
    assert (streamed.completed, streamed.failed) == (6, 0) and streamed.prefix_hit_rate == 0
    assert streamed.kv_bytes_max <= config.kv_bytes and streamed.running_max >= full.running_max
    assert streamed.agreement is not None and 0 <= streamed.agreement <= 1
