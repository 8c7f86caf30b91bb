"""meshplan: auto-parallelization planner for heterogeneous GPU clusters."""

__version__ = "0.1.0"
