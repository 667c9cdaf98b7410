"""Mamba-3 (SISO and MIMO): the trapezoidal, rotated state-space layer as a chunked SSD scan, with
states, segments and decode steps."""

from .api import OP, STEP_OP, Mamba3BlockSizes, Mamba3State, mamba3_positional, mamba3_step_positional
from .named import mamba3, mamba3_step

__all__ = [
    "OP",
    "STEP_OP",
    "Mamba3BlockSizes",
    "Mamba3State",
    "mamba3",
    "mamba3_positional",
    "mamba3_step",
    "mamba3_step_positional",
]
