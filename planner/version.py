"""meshplan's version, in one module that imports nothing (the package, the CLI and the
what-if cache key read it; pyproject.toml states the same for the installed distribution)."""

__version__ = "0.1.0"
