"""How long the sequences sharing the accelerator are: one fixed length, given lengths, or a long-tailed law.

Spec strings (``--lengths``)::

    2048   or   fixed:2048                 every sequence holds 2,048 tokens
    300,1200,4000   or   list:300,1200     these lengths, equally likely
    lengths.csv / lengths.json             one length per row (column 'length', 'tokens', 'num_tokens' or
                                           'seq_len', or the only column), or a JSON list / {"lengths": [...]}
    lognormal:median=600,max=8192[,sigma=1.0][,n=10000][,seed=0]
                                           seeded log-normal around the median, cut at max (requests that long
                                           are truncated to the context, so they pile up at max)
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_CSV_COLUMNS = ("length", "tokens", "num_tokens", "seq_len")


@dataclass(frozen=True)
class LengthDistribution:
    """Sequence lengths in tokens (a sample, equally weighted) and how they were obtained."""

    description: str
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError(f"The length distribution {self.description!r} has no lengths; give at least one.")
        bad = [x for x in self.lengths if isinstance(x, bool) or not isinstance(x, int) or x < 1]
        if bad:
            raise ValueError(
                f"Sequence lengths must be positive integers (tokens); {self.description!r} has {bad[:5]}."
            )

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    @property
    def max(self) -> int:
        return max(self.lengths)

    def quantile(self, q: float) -> int:
        """The smallest length with at least a ``q`` share of lengths at or below it."""
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def counts(self) -> Counter[int]:
        """Length -> how many times it occurs (the planner evaluates each distinct length once)."""
        return Counter(self.lengths)

    def summary(self) -> str:
        if len(set(self.lengths)) == 1:
            return f"{self.description}: every sequence {self.lengths[0]:,} tokens"
        return (
            f"{self.description}: n={len(self.lengths):,}, mean {self.mean:,.0f}, "
            f"median {self.quantile(0.5):,}, p99 {self.quantile(0.99):,}, max {self.max:,} tokens"
        )


def fixed(length: int) -> LengthDistribution:
    return LengthDistribution(f"fixed {length}", (length,))


def lognormal(median: int, max_len: int, sigma: float = 1.0, n: int = 10_000, seed: int = 0) -> LengthDistribution:
    """``n`` seeded log-normal lengths with the given median, rounded, clipped to [1, max_len]."""
    if median < 1 or max_len < median:
        raise ValueError(
            f"A log-normal length distribution needs 1 <= median <= max; got median={median}, max={max_len}."
        )
    if sigma <= 0 or n < 1:
        raise ValueError(f"A log-normal length distribution needs sigma > 0 and n >= 1; got sigma={sigma}, n={n}.")
    rng = random.Random(seed)
    mu = math.log(median)
    lengths = tuple(min(max_len, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n))
    text = f"log-normal median {median}, sigma {sigma}, cut at {max_len} (n={n}, seed={seed})"
    return LengthDistribution(text, lengths)


def _parse_int(text: str, what: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value.is_integer():
        raise ValueError(f"Cannot read {text!r} as {what}: give a whole number.")
    return int(value)


def _parse_lognormal(body: str) -> LengthDistribution:
    params: dict[str, str] = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("median", "max", "sigma", "n", "seed"):
            raise ValueError(
                f"Cannot read {item!r} in a log-normal spec; use key=value pairs of median, max, sigma, n, "
                "seed (e.g. 'lognormal:median=600,max=8192')."
            )
        params[key.strip()] = value.strip()
    if "median" not in params or "max" not in params:
        raise ValueError("A log-normal length spec needs median= and max= (e.g. 'lognormal:median=600,max=8192').")
    return lognormal(
        _parse_int(params["median"], "median"),
        _parse_int(params["max"], "max"),
        sigma=float(params.get("sigma", 1.0)),
        n=_parse_int(params.get("n", "10000"), "n"),
        seed=_parse_int(params.get("seed", "0"), "seed"),
    )


def _read_csv(path: Path) -> list[int]:
    rows = [row for row in csv.reader(path.read_text(encoding="utf-8").splitlines()) if row and any(row)]
    if not rows:
        return []
    header = [cell.strip().lower() for cell in rows[0]]
    column = next((header.index(name) for name in _CSV_COLUMNS if name in header), None)
    if column is None and len(header) == 1 and not header[0].isdigit():
        column = 0
    if column is not None:
        return [_parse_int(row[column], f"a length in {path}") for row in rows[1:]]
    if len(header) != 1:
        raise ValueError(
            f"{path} has several columns and none named {', '.join(_CSV_COLUMNS)}; name the length column."
        )
    return [_parse_int(row[0], f"a length in {path}") for row in rows]


def _read_json(path: Path) -> list[int]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = data.get("lengths")
    if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise ValueError(f'{path} must hold a JSON list of integer lengths or an object {{"lengths": [...]}}.')
    return data


def _from_file(path: Path) -> LengthDistribution:
    reader = _read_json if path.suffix.lower() == ".json" else _read_csv
    return LengthDistribution(f"lengths from {path.name}", tuple(reader(path)))


def parse_lengths(spec: str | int) -> LengthDistribution:
    """A LengthDistribution from a spec string (see the module docstring) or an int."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return fixed(spec)
    text = str(spec).strip()
    kind, sep, body = text.partition(":")
    if sep and kind == "lognormal":
        return _parse_lognormal(body)
    if sep and kind == "fixed":
        return fixed(_parse_int(body, "a fixed length"))
    if sep and kind == "list":
        return LengthDistribution("given lengths", tuple(_parse_int(x, "a length") for x in body.split(",") if x))
    if Path(text).is_file():
        return _from_file(Path(text))
    if text and all(part.strip().lstrip("-").replace(".", "", 1).isdigit() for part in text.split(",")):
        values = tuple(_parse_int(x.strip(), "a length") for x in text.split(","))
        return fixed(values[0]) if len(values) == 1 else LengthDistribution("given lengths", values)
    raise ValueError(
        f"Cannot read the sequence lengths {spec!r}: give a number ('2048'), a list ('300,1200,4000'), "
        "a .csv or .json file that exists, or 'lognormal:median=600,max=8192'."
    )
