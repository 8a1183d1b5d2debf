"""Weaver: resource discovery and stage→pool planning. This issue ships discovery; planning comes next."""

from weaver.discover import Resources, discover

__all__ = ["Resources", "discover"]
