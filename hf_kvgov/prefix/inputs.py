"""Checks and conversions of the arguments the prefix tree accepts, each failing with a full sentence."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Sequence


def positive_int(value: object, name: str) -> int:
    """``value`` as an int > 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int > 0; got {type(value).__name__} {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be an int > 0; got {value}.")
    return value


def non_negative_int(value: object, name: str) -> int:
    """``value`` as an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 0; got {type(value).__name__} {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0; got {value}.")
    return value


def namespace(value: object) -> str:
    """``value`` as a namespace (cache salt) string."""
    if not isinstance(value, str):
        raise TypeError(f'namespace must be a str ("" for the shared namespace); got {type(value).__name__}.')
    return value


def token_list(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` as a list of Python ints (tensors and numpy arrays are accepted, lists are fastest)."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError("token_ids must be a sequence of int token ids; got a string. Tokenize it first.")
    try:
        return [operator.index(token) for token in token_ids]
    except TypeError as error:
        raise TypeError(
            f"token_ids must be a sequence of int token ids; got {type(token_ids).__name__} with an element "
            f"that is not an int ({error})."
        ) from None


def block_id_list(block_ids: Iterable[int], name: str = "block_ids") -> list[int]:
    """``block_ids`` as a list of ints >= 0 (repeats allowed; see :func:`distinct`)."""
    out = []
    for block_id in block_ids:
        if isinstance(block_id, bool):
            raise TypeError(f"{name} must hold int block ids; got bool {block_id!r}.")
        try:
            value = operator.index(block_id)
        except TypeError:
            raise TypeError(f"{name} must hold int block ids; got {type(block_id).__name__} {block_id!r}.") from None
        if value < 0:
            raise ValueError(f"{name} must hold block ids >= 0; got {value}.")
        out.append(value)
    return out


def distinct(block_ids: list[int], name: str = "block_ids") -> list[int]:
    """``block_ids`` unchanged, after checking that no id appears twice."""
    repeated = sorted(block_id for block_id, count in Counter(block_ids).items() if count > 1)
    if repeated:
        raise ValueError(
            f"{name} must not repeat a block id (a block holds one position of one prompt); got repeats of {repeated}."
        )
    return block_ids
