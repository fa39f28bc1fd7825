"""`kvgov serve`: transformers' OpenAI-compatible server (`transformers serve --continuous-batching`), its continuous
batching run by the governed engine.

transformers' server loads each model in a process of its own through its `ModelLoader`, a copy of which the process
receives. `run_server` hands the server a `GovernedModelLoader`, whose load installs the engine on the model it
loaded (`hf_kvgov.serving.install`), so the server's batching manager is `GovernedBatchingManager`: its requests share
one block pool under one byte cap, with prefix sharing and codes as configured. Its `GovernedModelManager` answers
to the name `kvgov serve` was given as well as to the id the model loads by. Needs transformers' serving extras
(`pip install hf-kvgov[serve]`: fastapi, uvicorn, openai).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from transformers import AutoConfig
from transformers.cli import serve as transformers_serve
from transformers.cli.serving import model_manager

from hf_kvgov import models
from hf_kvgov.serving.engine import check_servable
from hf_kvgov.serving.transformers_api import install


class GovernedModelLoader(model_manager.ModelLoader):
    """transformers' model loader, plus the governed engine on every model it loads.

    The server builds its loader itself, so `run_server` sets the class's `engine_args` (`install`'s) first; each
    loader keeps a copy, which travels with it to the model's process.
    """

    engine_args: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine_args = dict(type(self).engine_args)  # type: ignore[misc]

    def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> tuple[Any, Any]:
        model, processor = super().load_model_and_processor(model_id, on_progress)
        try:
            install(model, **self.engine_args)
        except ValueError:
            # The engine refused the model (`kvgov serve` prints the reason in one line): transformers' model process
            # would log the refusal with a traceback first, as it logs a crash.
            logging.getLogger(model_manager.__name__).disabled = True
            raise
        return model, processor


class GovernedModelManager(model_manager.ModelManager):
    """transformers' model manager, answering for the served model under the name `kvgov serve` was given too.

    A server pinned to one model answers only requests that name the id it loads the model by, which for an embedded
    model is its GGUF's path in the local cache: a client that sends ``model="smollm2"``, as ``kvgov serve --help``
    shows, would get a 400. `run_server` sets `served_name`; `/v1/models` lists the model under it.
    """

    served_name: ClassVar[str | None] = None

    def get_engine(self, model: str | None) -> Any:
        if model is not None and model == self.served_name:
            model = self.force_model
        return super().get_engine(model)

    def list_models(self, cache_dir: str | None = None) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = super().list_models(cache_dir)
        if self.force_model is not None and self.served_name is not None:
            listed = [{**entry, "id": self.served_name} for entry in listed]
        return listed


def server_model_id(name: str) -> str:
    """The id transformers' server loads `name` by: an embedded model's GGUF as ``<directory>:<file>.gguf`` (fetched
    once if it is not yet), a ``.gguf`` path likewise, anything else (a hub id, a local directory) as given."""
    if name in models.EMBEDDED_MODELS:
        path = models.fetch(name, quiet=True)
    elif name.endswith(".gguf"):
        path = Path(name).resolve()
        if not path.is_file():
            raise ValueError(f"No GGUF file at {name!r}.")
    else:
        return name
    return f"{path.parent}:{path.name}"


def check_model_before_loading(name: str) -> None:
    """Refuse, before the server loads any weights, a model the engine cannot serve (`check_servable` on a config at
    hand: a model directory's, or a hub id's in the local Hugging Face cache). An embedded or ``.gguf`` model, or a
    hub id not yet downloaded, is checked when its process loads it."""
    if name in models.EMBEDDED_MODELS or name.endswith(".gguf"):
        return
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        return  # not at hand: the model's process downloads and checks it
    check_servable(config)


def run_server(name: str, host: str, port: int, log_level: str = "info", **engine_args: Any) -> None:
    """Serve `name` on `host:port` until interrupted; each request's KV lives in the governed engine's pool."""
    model_id = server_model_id(name)
    own_loader, own_manager = model_manager.ModelLoader, model_manager.ModelManager
    GovernedModelLoader.engine_args = dict(engine_args)
    GovernedModelManager.served_name = name
    model_manager.ModelLoader = GovernedModelLoader  # type: ignore[misc]
    model_manager.ModelManager = GovernedModelManager  # type: ignore[misc]
    try:
        transformers_serve.Serve(
            force_model=model_id,
            continuous_batching=True,
            host=host,
            port=port,
            dtype="float32",
            log_level=log_level,
        )
    finally:
        model_manager.ModelLoader = own_loader  # type: ignore[misc]
        model_manager.ModelManager = own_manager  # type: ignore[misc]
