"""Nemesis: a centralized event-delivery proxy."""

__version__ = "0.1.0"
