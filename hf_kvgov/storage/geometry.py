"""`KVGeometry`: the shape of a pool's K/V and where each layer's blocks live.

A model split over several accelerators (`device_map="auto"`) runs layer l on its own device, and its
K/V arrive there. The pool keeps layer l's blocks on that same device, so no block ever crosses a device
boundary on the hot path::

    layer_devices = (cuda:0, cuda:0, cuda:1, cuda:1)
    keys[0], keys[1] on cuda:0        keys[2], keys[3] on cuda:1        (values likewise)

Block ids stay global (one id spans all layers): only the memory behind an id is per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class KVGeometry:
    """Shape and placement of the KV of one group of layers that share a pool.

    Args:
        num_layers, num_kv_heads, head_dim: the K/V shape of one token of one layer is
            `[num_kv_heads, head_dim]`.
        dtype: floating-point dtype of the full-precision blocks.
        device: where every layer's blocks live unless `layer_devices` says otherwise; also where
            layer-independent index tensors (block tables, slots) are built. With `layer_devices` it is the
            first layer's device: left at its default (CPU) it is set to `layer_devices[0]`.
        layer_devices: one device per layer (a tuple of `torch.device` or device strings), or None for all
            layers on `device`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    layer_devices: tuple[torch.device, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int; got {value!r}.")
        if not self.dtype.is_floating_point:
            raise TypeError(f"KVGeometry.dtype must be a floating-point torch dtype; got {self.dtype}.")
        if self.layer_devices is not None:
            self._check_layer_devices(self.layer_devices)

    def _check_layer_devices(self, given: object) -> None:
        if isinstance(given, (str, torch.device)) or not isinstance(given, Sequence):
            raise TypeError(
                f"KVGeometry.layer_devices must be a tuple with one torch.device per layer, or None; got {given!r}."
            )
        devices = tuple(_as_device(d) for d in given)
        if len(devices) != self.num_layers:
            raise ValueError(
                f"KVGeometry.layer_devices must name one device per layer ({self.num_layers}); got {len(devices)}: "
                f"{[str(d) for d in devices]}."
            )
        object.__setattr__(self, "layer_devices", devices)
        device = torch.device(self.device)
        if device != devices[0]:
            if device != _CPU:
                raise ValueError(
                    f"KVGeometry.device ({device}) must be the first layer's device ({devices[0]}) when "
                    "layer_devices is given; leave device out or make the two agree."
                )
            object.__setattr__(self, "device", devices[0])

    def layer_device(self, layer: int) -> torch.device:
        """Where layer `layer`'s blocks live."""
        return self.device if self.layer_devices is None else self.layer_devices[layer]

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The distinct devices holding blocks, in layer order."""
        return tuple(dict.fromkeys(self.layer_device(layer) for layer in range(self.num_layers)))

    def with_layer_device(self, layer: int, device: torch.device) -> KVGeometry:
        """The same geometry with layer `layer` on `device`."""
        devices = [self.layer_device(i) for i in range(self.num_layers)]
        devices[layer] = torch.device(device)
        return dataclasses.replace(self, device=devices[0], layer_devices=tuple(devices))

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers of the group."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def zero_extended(old: torch.Tensor, extra: int) -> torch.Tensor:
    """``old`` followed by ``extra`` zeroed rows (dim 0), written once (no separate zeros tensor + cat).

    New blocks are zeroed, not left uninitialised: attention reads whole blocks and masks the unwritten
    slots, and a NaN bit pattern there would survive the mask (0 x NaN is NaN).
    """
    kept = old.shape[0]
    grown = torch.empty((kept + extra, *old.shape[1:]), dtype=old.dtype, device=old.device)
    grown[:kept].copy_(old)
    grown[kept:].zero_()
    return grown


def index_per_layer(ids: Sequence[int], geometry: KVGeometry) -> list[torch.Tensor]:
    """`ids` as a long tensor on each layer's device (built once per distinct device), indexed by layer."""
    on_device = {device: torch.tensor(list(ids), dtype=torch.long, device=device) for device in geometry.devices}
    return [on_device[geometry.layer_device(layer)] for layer in range(geometry.num_layers)]


def check_on_device(layer: int, blocks: torch.device, name: str, tensor: torch.Tensor) -> None:
    """Raise a `ValueError` if `tensor` (the layer's `name`) is not on `blocks`, its blocks' device."""
    if tensor.device != blocks:
        raise ValueError(
            f"Layer {layer}'s blocks are on {blocks} but its {name} arrived on {tensor.device}; the pool never moves "
            f"K/V between devices. Build the pool with layer_devices placing layer {layer} on {tensor.device}, or "
            f"run that layer on {blocks}."
        )


def check_placement(wanted: Sequence[torch.device | None], actual: Sequence[torch.device]) -> None:
    """Raise a `ValueError` naming every layer whose blocks (`actual[l]`) are not where it runs (`wanted[l]`).

    None in `wanted`: not known yet (any device). A device without an index ("cuda") names any of its kind.
    """
    mismatched = [
        f"layer {layer}: blocks on {blocks}, layer runs on {runs}"
        for layer, (runs, blocks) in enumerate(zip(wanted, actual, strict=True))
        if runs is not None and runs != blocks and not (runs.index is None and runs.type == blocks.type)
    ]
    if mismatched:
        raise ValueError(
            f"The pool keeps blocks on other devices than the layers run on ({'; '.join(mismatched)}); build the "
            "pool with KVGeometry(layer_devices=...) matching the model's device map, or let the cache create it."
        )


def _as_device(device: object) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"KVGeometry.layer_devices holds {device!r}, which is not a torch device name.") from err
    raise TypeError(
        f"KVGeometry.layer_devices entries must be torch.device or device strings; got {type(device).__name__} "
        f"{device!r}."
    )
