"""Mamba-2 state-space duality (SSD): chunked scan with states, segments and decode steps."""

from .api import OP, STEP_OP, SSDBlockSizes, ssd_positional, ssd_step_positional
from .named import ssd, ssd_step

__all__ = [
    "OP",
    "STEP_OP",
    "SSDBlockSizes",
    "ssd",
    "ssd_positional",
    "ssd_step",
    "ssd_step_positional",
]
