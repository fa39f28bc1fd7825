"""The shape of a model's KV cache: what the planner needs to know about a model, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvgov.planner.units import kv_dtype_bytes


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int; got {value!r}.")


@dataclass(frozen=True)
class ModelGeometry:
    """Layers, KV heads and head size of a decoder, and which of its layers attend in a sliding window.

    Args:
        name: how the model is shown in reports.
        num_layers: decoder layers, each with its own keys and values.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA/MQA).
        head_dim: channels per head.
        max_position_embeddings: the trained context length.
        sliding_window: tokens a sliding-window layer attends to (None: no such layers).
        sliding_layers: indices of the layers that use ``sliding_window``; the others attend to all
            tokens. Must be empty when ``sliding_window`` is None.
        num_params: parameters of the whole model, for weight memory (None: unknown).
        shared_kv_layers: further layers that attend over an earlier layer's keys and values and store none
            (KV sharing, Gemma-3n); they cost nothing here and are only named in `describe`.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    num_params: int | None = None
    shared_kv_layers: int = 0

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_positive_int("ModelGeometry", field_name, getattr(self, field_name))
        if self.sliding_window is not None:
            _check_positive_int("ModelGeometry", "sliding_window", self.sliding_window)
        if self.num_params is not None:
            _check_positive_int("ModelGeometry", "num_params", self.num_params)
        if (
            isinstance(self.shared_kv_layers, bool)
            or not isinstance(self.shared_kv_layers, int)
            or self.shared_kv_layers < 0
        ):
            raise ValueError(f"ModelGeometry.shared_kv_layers must be an int >= 0; got {self.shared_kv_layers!r}.")
        if self.sliding_window is None and self.sliding_layers:
            raise ValueError(
                f"ModelGeometry {self.name!r} lists sliding layers {list(self.sliding_layers)} but no "
                "sliding_window; give the window size or an empty sliding_layers."
            )
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.sliding_layers)) != len(self.sliding_layers):
            raise ValueError(
                f"ModelGeometry {self.name!r}: sliding_layers must be distinct indices in "
                f"[0, {self.num_layers}); got {list(self.sliding_layers)}."
            )

    @property
    def num_sliding_layers(self) -> int:
        return len(self.sliding_layers)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for full attention: what `layer_groups` groups layers by."""
        sliding = set(self.sliding_layers)
        return tuple(self.sliding_window if layer in sliding else None for layer in range(self.num_layers))

    def kv_bytes_per_token(self, dtype: str = "fp16") -> int:
        """K and V bytes of one token over all layers: 2 x layers x kv_heads x head_dim x element size.

        This is the raw figure (LLaMA-13B in fp16: 2 x 40 x 40 x 128 x 2 = 819,200 B); it ignores the
        sliding-window cap, which limits how many tokens a layer holds, not what one token costs.
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes(dtype)

    def describe(self) -> str:
        """One line: 'LLaMA-13B: 40 layers x 40 KV heads x head_dim 128, context 2048'."""
        text = (
            f"{self.name}: {self.num_layers} layers x {self.num_kv_heads} KV heads x head_dim "
            f"{self.head_dim}, context {self.max_position_embeddings}"
        )
        if self.sliding_window is not None:
            window, count = self.sliding_window, self.num_sliding_layers
            text += f", sliding window {window} on {count} of {self.num_layers} layers"
        if self.shared_kv_layers:
            text += f", and {self.shared_kv_layers} more layers that reuse earlier layers' K/V"
        if self.num_params is not None:
            text += f", {self.num_params / 1e9:.3g}B parameters"
        return text
