"""The command line's argument types: numbers checked as they are parsed, before any
work (that they are numbers, finite, and in the ranges the library does not name
itself), shared by every command's parser."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["ANY_INT", "COUNT", "INT_LIMIT", "integer", "number", "rate"]

# The largest integer an option takes: beyond it sizes overflow numpy's and torch's
# (``--batch 99999999999999999999`` raised OverflowError), and no run needs one.
INT_LIMIT = 2**31 - 1


def integer(least: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer of at most :data:`INT_LIMIT` and at least ``least``.
    ``least`` is for options the library would misread (a 0 taken as "the default", a
    negative size); None leaves the range to the library, whose message says more (a
    setting is 1..10, K at most the layers)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if least is not None and n < least:
            rule = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise argparse.ArgumentTypeError(f"{n} is not {rule}")
        if abs(n) > INT_LIMIT:
            raise argparse.ArgumentTypeError(f"{n} is beyond {INT_LIMIT}, the largest tplib takes")
        return n

    return parse


def number(least: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``least`` (> with ``above``)."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if x < least or (above and x == least):
            raise argparse.ArgumentTypeError(f"{text} is not {'>' if above else '>='} {least:g}")
        return x

    return parse


COUNT, ANY_INT = integer(1), integer()


def rate(text: str) -> float:
    """An argparse type: a rate in [0, 1), as a dropout probability is."""
    x = number(0)(text)
    if x >= 1:
        raise argparse.ArgumentTypeError(f"{text} is not < 1")
    return x


DISTRIBUTED_OPTIMIZER = (
    "shard the optimizer state over #Data (Megatron's distributed optimizer: gradients "
    "reduce-scattered, each replica steps its shard, parameters all-gathered)"
)
