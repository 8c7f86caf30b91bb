"""meshplan.models: the built-in model zoo."""
