"""`kvgov serve`'s mistakes: one line naming what was wrong and a non-zero exit, before any model loads."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import transformers

from hf_kvgov.cli.main import build_parser, main
from hf_kvgov.cli.serve import engine_args
from hf_kvgov.engine.parts import HeavyHitter
from tests.char_tokenizer import char_tokenizer


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--codec", "int3"], "Unknown codec 'int3'"),
        (["--kv-budget", "lots"], "KV byte cap"),
        (["--model", "/nowhere/model.gguf"], "No GGUF file at '/nowhere/model.gguf'"),
        (["--swap-dir", __file__], "path must be a directory for the spill file"),
        (["--h2o", "1.5"], "--h2o takes what each request keeps: a fraction in (0, 1] with a decimal point (0.2) or a"),
        (["--h2o", "0"], "number of tokens (256); got '0'."),
        (["--h2o", "most"], "got 'most'."),
        (["--redis", "localhost:6379"], "--redis takes a redis://, rediss:// or unix:// URL; got 'localhost:6379'"),
        (["--redis", "redis://127.0.0.1:1/0", "--no-prefix-sharing"], "cannot go with --no-prefix-sharing"),
        (["--port", "99999"], "--port takes 0 to 65535 (0: any free port); got 99999."),
        (["--preallocate"], "--preallocate needs --kv-budget (the cap it reserves)."),
        (["--preallocate", "--kv-budget", "1GiB", "--codec", "int8"], "--preallocate needs no --codec"),
        (["--block-size", "0"], "--block-size must be at least 1; got 0."),
        (["--max-batched-tokens", "0"], "--max-batched-tokens must be at least 1; got 0."),
        (["--log-level", "loud"], "--log-level takes one of critical, error, warning, info, debug, trace; got 'loud'"),
    ],
)
def test_bad_options_get_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("value", "policy"), [("0.2", HeavyHitter(0.2)), ("512", HeavyHitter(512))])
def test_h2o_takes_a_share_of_the_prompt_or_a_number_of_tokens(value: str, policy: HeavyHitter) -> None:
    """As cache names do (`h2o@0.2`, `h2o@512`): a token budget keeps a short chat whole (the engine's tests show a
    budget above the request's length changes no token)."""
    args = build_parser().parse_args(["serve", "--h2o", value, "--kv-budget", "64MiB"])
    assert engine_args(args)["policy"] == policy
    assert engine_args(build_parser().parse_args(["serve"])).get("policy") is None


def test_a_port_already_taken_gets_one_line_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"Cannot listen on 127.0.0.1:{port} (Address already in use)" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("model_type", "fields", "message"),
    [
        ("t5", {}, "t5 is an encoder-decoder model"),
        ("deepseek_v3", {"kv_lora_rank": 32, "q_lora_rank": None}, "deepseek_v3 uses multi-head latent attention"),
    ],
)
def test_a_model_the_engine_cannot_serve_gets_one_line_before_its_weights_load(
    model_type: str, fields: dict[str, object], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **fields,
    )  # fmt: skip
    config.save_pretrained(tmp_path)  # the config alone: the refusal comes before any weights are read
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_model_the_engine_refuses_after_loading_gets_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Bloom's config looks servable; the engine refuses the loaded model (its attention never reaches the engine's
    step) in the model's process, which transformers' server relays: one line, no traceback from either process."""
    torch.manual_seed(0)
    bloom = transformers.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4)
    transformers.AutoModelForCausalLM.from_config(bloom).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    err = capfd.readouterr().err
    assert "kvgov serve: error: BloomForCausalLM cannot be served by the engine: layers [0, 1]" in err, err
    assert "Traceback" not in err, err
