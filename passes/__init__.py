"""meshplan.passes: pure functions over the IR (Graph -> Graph or Graph -> Analysis)."""

from .partition import even_stages, place_stages, replica_capacity

__all__ = ["even_stages", "place_stages", "replica_capacity"]
