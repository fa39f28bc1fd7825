"""`kvgov serve` end to end: transformers' OpenAI-compatible server started on loopback, its continuous batching on
the governed engine, talked to by the real `openai` client. A streamed completion is the model's greedy answer; a
stream the client closes early is cancelled and its blocks go back to the pool (the server's log line says so)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis as redis_client
import torch
from transformers import DynamicCache

from hf_kvgov.tiers.local_redis import LocalRedis

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPT = "It is a truth universally acknowledged"
CANCELLED = re.compile(r"kvgov: request (\S+) cancelled; KV bytes in use (\d+) of \d+, requests running 0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> Iterator[tuple[str, Path]]:
    """`kvgov serve` without prefix sharing (so a cancelled request leaves nothing held)."""
    yield from _serve(tmp_path_factory, ["--no-prefix-sharing"])


def _serve(tmp_path_factory: pytest.TempPathFactory, options: list[str]) -> Iterator[tuple[str, Path]]:
    """`kvgov serve` in its own process group (the server spawns the model's process), stopped after the tests."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    command = [sys.executable, "-m", "hf_kvgov.cli.main", "serve", "--port", str(port), *options]
    command += ["--kv-budget", "64MiB", "--block-size", "16"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"kvgov serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"kvgov serve did not answer within 300 s:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield url, log
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def _greedy_alone(smollm2: Any, prompt: str, new: int) -> str:
    model, tokenizer = smollm2
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, cache=DynamicCache(config=model.config))
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def test_a_streamed_completion_is_the_greedy_answer(server: tuple[str, Path], smollm2: Any) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream]
    assert len(pieces) > 1  # it came in pieces, as generated
    assert "".join(pieces) == _greedy_alone(smollm2, PROMPT, 16)


def test_the_model_answers_to_the_name_the_server_was_given(server: tuple[str, Path], smollm2: Any) -> None:
    """`kvgov serve` (the embedded model) is asked for ``model="smollm2"``, as its help shows; transformers' pinned
    server would answer that with a 400, since it loads the model by its GGUF's path. Another name is still refused."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [entry.id for entry in client.models.list().data] == ["smollm2"]
    answer = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.choices[0].text == _greedy_alone(smollm2, PROMPT, 8)
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="gemma3-270m", prompt=PROMPT, max_tokens=4)
    assert "requested 'gemma3-270m'" in refused.value.response.text


def test_a_sampled_completion_with_a_seed_is_reproducible(server: tuple[str, Path]) -> None:
    """The server seeds torch's generator with a request's `seed`; the engine draws the request's own seed from it.
    (The model's generation config does not sample: the request's own `generation_config` turns sampling on.)"""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    sampling = {"generation_config": json.dumps({"do_sample": True})}

    def sampled(seed: int) -> str:
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=seed, extra_body=sampling
        )
        return str(answer.choices[0].text)

    first, again, other = sampled(7), sampled(7), sampled(8)
    assert first == again
    assert first != other  # the seed, not greedy decoding, made them equal


def test_a_closed_stream_is_cancelled_and_frees_its_blocks(server: tuple[str, Path]) -> None:
    url, log = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True
    )
    for index, _ in enumerate(stream):
        if index == 2:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while not (found := CANCELLED.findall(log.read_text())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert found, f"no cancellation in the server's log:\n{log.read_text()[-2000:]}"
    assert found[-1][1] == "0"  # no prefix sharing: nothing else holds a block


def test_a_server_on_redis_publishes_the_prefixes_it_computed(
    tmp_path_factory: pytest.TempPathFactory, smollm2: Any
) -> None:
    """`kvgov serve --redis URL`: the model's engine shares what it publishes through a real redis-server, so
    another server on the same Redis would compute none of it (tests/serving/test_engine_remote.py shows that)."""
    redis = LocalRedis().start()
    served = _serve(tmp_path_factory, ["--redis", redis.url])
    try:
        url, _ = next(served)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        prompt = " ".join([PROMPT] * 8)  # about 60 tokens: three full blocks to publish
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert answer.choices[0].text == _greedy_alone(smollm2, prompt, 8)
        store = redis_client.Redis.from_url(redis.url)
        deadline = time.monotonic() + 30
        while not store.keys(b"kvgov:*") and time.monotonic() < deadline:  # the tier writes from its own thread
            time.sleep(0.5)
        assert len(store.keys(b"kvgov:*")) >= 3
        store.close()
    finally:
        served.close()  # stops the server, whose engine closes its tier
        redis.stop()
