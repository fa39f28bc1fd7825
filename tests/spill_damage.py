"""Damaging a spill file the way a bad sector or a stray write would: one byte, in place."""

from __future__ import annotations


def flip_byte(path: str, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at `offset` of the file at `path` with `mask` (the checksum must then catch the block)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
