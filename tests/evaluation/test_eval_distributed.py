"""Data-parallel evaluation: how work is shared, and a two-process `accelerate launch` run against one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_kvgov.cli.main import main
from hf_kvgov.evaluation.distributed import Workers, current_workers, single_process
from tests.evaluation.eval_tiny import LONGBENCH_DIR, save_tiny_model

REPO = Path(__file__).resolve().parents[2]


def test_every_item_goes_to_exactly_one_process() -> None:
    items = list(range(11))
    shares = [Workers(index, 3, torch.device("cpu")).share(items) for index in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert [Workers(index, 3, torch.device("cpu")).is_main for index in range(3)] == [True, False, False]


def test_one_process_runs_everything_and_gathers_what_it_has() -> None:
    workers = single_process()
    assert workers.share([1, 2, 3]) == [1, 2, 3] and workers.gather(["a"]) == ["a"]
    assert workers.map([1, 2, 3], lambda item: [item, -item], "test") == [1, -1, 2, -2, 3, -3]
    here = current_workers()  # no launcher: accelerate reports a single process
    assert (here.index, here.count) == (0, 1)
    with pytest.raises(ValueError, match=r"must lie in \[0, count\) with count >= 1; got 2 of 2"):
        Workers(2, 2, torch.device("cpu"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_processes_give_the_numbers_of_one(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny")
    argv = ["eval", "longbench", "--model", str(model_dir), "--data", str(LONGBENCH_DIR)]
    argv += ["--caches", "dynamic,h2o@0.5", "--max-new-tokens", "4"]
    # `accelerate launch --cpu` starts a single process (multi-CPU needs an MPI hostfile); --multi_gpu starts
    # N processes through torchrun, and hf_kvgov builds their group on gloo when there is no CUDA.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port()), "-m", "hf_kvgov.cli.main"]
    two = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [*launch, *argv, "--json", str(two)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("### LongBench (score x100)") == 1  # only the main process prints
    one = tmp_path / "one.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the launched processes run one thread each: the same arithmetic
    try:
        assert main([*argv, "--json", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    merged, single = json.loads(two.read_text()), json.loads(one.read_text())
    assert (merged["processes"], single["processes"]) == (2, 1)
    for key in ("tasks", "average", "kv_bytes", "samples"):
        assert merged[key] == single[key], key
    assert len(merged["samples"]) == 7 * 2
