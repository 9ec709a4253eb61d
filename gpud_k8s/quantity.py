"""Kubernetes quantities (``resource.Quantity``: ``25``, ``500m``, ``20Gi``, ``1.5G``, ``1e3``) read
exactly, as the API server writes them, and written in their canonical form for whole numbers."""

from __future__ import annotations

import re
from fractions import Fraction

BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1)}
DECIMAL.update({"k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12)})
DECIMAL.update({"P": Fraction(10**15), "E": Fraction(10**18)})
_FORM = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?\d+))?$")


class QuantityError(ValueError):
    pass


def parse(text: object) -> Fraction:
    """The exact value of a quantity (a string as the API writes it, or a plain number)."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise QuantityError(f"{text!r} is not a quantity (a number, or a string such as 25, 500m or 20Gi)")
    if isinstance(text, int):
        return Fraction(text)
    m = _FORM.match(text.strip())
    if m is None:
        raise QuantityError(f"{text!r} is not a quantity (a number, or a string such as 25, 500m or 20Gi)")
    sign, number, suffix, exponent = m.groups()
    value = Fraction(number)
    if suffix in BINARY:
        value *= BINARY[suffix]
    elif suffix is not None:
        value *= DECIMAL[suffix]
    elif exponent is not None:
        value *= Fraction(10) ** int(exponent)
    return -value if sign == "-" else value


def whole(text: object, what: str) -> int:
    """A quantity that must be a whole number (bytes, cores in percent)."""
    value = parse(text)
    if value.denominator != 1:
        raise QuantityError(f"{what} {text!r} is not a whole number")
    return int(value)


def binary(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it (``20Gi``, ``256Mi``, ``1536``)."""
    for suffix, size in reversed(BINARY.items()):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)
