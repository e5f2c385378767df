"""Stores: the database seam (``base``), MongoDB (``mongo``) and its in-memory twin (``memory``)."""

from __future__ import annotations

from taskrunner.store.base import ChangeEvent, Claim, Store

__all__ = ["ChangeEvent", "Claim", "Store"]
