"""The sigmoid compute-performance curve of the paper and its derivatives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CurveParams:
    """R(C) = r0 + (a - r0) / (1 + (c_mid / C) ** b)."""

    a: float
    b: float
    c_mid: float
    r0: float

    def predict(self, x: np.ndarray | float) -> np.ndarray:
        """R at compute ``x`` ([N] or scalar); R(0) = r0."""
        return sigmoid_curve(np.asarray(x, dtype=np.float64), self.a, self.b, self.c_mid, self.r0)


def log_ratio(c_mid: np.ndarray | float, x: np.ndarray) -> np.ndarray:
    """log(c_mid / x), +inf where x == 0 (broadcasts like ``c_mid / x``)."""
    with np.errstate(divide="ignore"):
        return np.log(c_mid) - np.log(x)


def gain_fraction(b: np.ndarray | float, log_cmid_over_x: np.ndarray) -> np.ndarray:
    """1 / (1 + (c_mid / x) ** b) from log(c_mid / x); exp overflows to inf, giving 0."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(np.asarray(b) * log_cmid_over_x))


def sigmoid_curve(x: np.ndarray, a: float, b: float, c_mid: float, r0: float) -> np.ndarray:
    """The paper's curve at compute ``x`` [N] (x >= 0)."""
    if np.any(x < 0):
        raise ValueError("compute x must be >= 0")
    return r0 + (a - r0) * gain_fraction(b, log_ratio(c_mid, x))
