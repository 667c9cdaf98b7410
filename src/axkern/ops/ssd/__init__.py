"""Mamba-2 state-space duality (SSD): chunked scan with states, segments and decode steps."""

from .api import OP, SSDBlockSizes, ssd, ssd_positional, ssd_step_positional

__all__ = ["OP", "SSDBlockSizes", "ssd", "ssd_positional", "ssd_step_positional"]
