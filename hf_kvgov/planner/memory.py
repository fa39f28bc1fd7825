"""What is left of an accelerator for the KV cache once the weights and a reserve are taken out.

The reserve (default 10% of the accelerator) stands for everything that is neither weights nor KV:
activations of the largest batch, the CUDA context and library workspaces (cuBLAS, flash-attn), and
allocator fragmentation. 10% is a rough figure for decoder inference at moderate batch sizes; measure
your own with ``torch.cuda.max_memory_allocated`` and pass it with ``--reserve``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.units import WEIGHT_DTYPE_BYTES, format_bytes, normalize_dtype

DEFAULT_RESERVE = 0.10


@dataclass(frozen=True)
class MemoryBudget:
    """Accelerator bytes split into weights, reserve and the KV cache budget.

    Args:
        accelerator_bytes: memory of the accelerator (one device).
        weight_bytes: bytes of the model's weights.
        reserve_fraction: share of ``accelerator_bytes`` kept for activations and overheads, in [0, 1).
        description: how the weights were sized, for reports.
    """

    accelerator_bytes: int
    weight_bytes: int
    reserve_fraction: float = DEFAULT_RESERVE
    description: str = ""

    def __post_init__(self) -> None:
        if self.accelerator_bytes <= 0:
            raise ValueError(f"The accelerator memory must be positive; got {self.accelerator_bytes} bytes.")
        if self.weight_bytes < 0:
            raise ValueError(f"The weight memory cannot be negative; got {self.weight_bytes} bytes.")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(
                f"The reserve is a fraction of accelerator memory in [0, 1) (0.1 = 10%); got {self.reserve_fraction}."
            )
        usable = self.accelerator_bytes - self.reserve_bytes
        if self.weight_bytes >= usable:
            raise ValueError(
                f"The weights ({self.description or format_bytes(self.weight_bytes)}) do not fit: "
                f"{format_bytes(self.accelerator_bytes)} of accelerator memory less the "
                f"{self.reserve_fraction:.0%} reserve leaves {format_bytes(usable)}, and the weights need "
                f"{format_bytes(self.weight_bytes)}, so nothing is left for the KV cache. Use a larger "
                "accelerator, int8/int4 weights, a smaller reserve, or a smaller model."
            )

    @property
    def reserve_bytes(self) -> int:
        return round(self.accelerator_bytes * self.reserve_fraction)

    @property
    def kv_bytes(self) -> int:
        """Bytes the KV cache may use."""
        return self.accelerator_bytes - self.reserve_bytes - self.weight_bytes

    def describe(self) -> str:
        return (
            f"{format_bytes(self.accelerator_bytes)} accelerator - {format_bytes(self.weight_bytes)} weights "
            f"({self.description}) - {format_bytes(self.reserve_bytes)} reserve "
            f"({self.reserve_fraction:.0%}) = {format_bytes(self.kv_bytes)} for the KV cache"
        )


def budget_for_model(
    geometry: ModelGeometry,
    accelerator_bytes: int,
    weight_dtype: str = "fp16",
    reserve_fraction: float = DEFAULT_RESERVE,
    num_params: int | None = None,
) -> MemoryBudget:
    """A MemoryBudget whose weights are ``num_params`` (default: the geometry's) x ``weight_dtype``."""
    dtype = normalize_dtype(weight_dtype, WEIGHT_DTYPE_BYTES, "weight dtype")
    params = num_params if num_params is not None else geometry.num_params
    if params is None:
        raise ValueError(
            f"The parameter count of {geometry.name} is unknown (its config is not a dense decoder the "
            "planner can count); pass it, e.g. --params 7.2B."
        )
    if params <= 0:
        raise ValueError(f"The parameter count must be positive; got {params}.")
    weight_bytes = round(params * WEIGHT_DTYPE_BYTES[dtype])
    text = f"{params / 1e9:.3g}B parameters x {WEIGHT_DTYPE_BYTES[dtype]:.4g} B in {dtype}"
    return MemoryBudget(accelerator_bytes, weight_bytes, reserve_fraction, text)
