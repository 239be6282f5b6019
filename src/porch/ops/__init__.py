"""Operating porch: the ``porch`` command (demo, inspect, reset, purge, check)."""

__all__: list[str] = []
