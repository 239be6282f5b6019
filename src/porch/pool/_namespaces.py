"""Counter namespaces taken on one key pool, so two limiters never share a counter by accident.

Every rule (of a middleware, or declared on a route) claims its name on the
pool it counts through when it is built. A name claimed again with the same
meaning (the same path, methods and limits: the same app built twice, as tests
do) is the same policy; with another meaning it is a ConfigurationError, unless
both rules say ``shared=True`` and have the same limits.
"""

from __future__ import annotations

from ..errors import ConfigurationError

__all__ = ["Namespaces"]


class Namespaces:
    """The names claimed on one pool, with what each means and who claimed it first."""

    __slots__ = ("_taken",)

    def __init__(self) -> None:
        self._taken: dict[str, tuple[tuple[object, ...], str]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._taken

    def claim(self, name: str, signature: tuple[object, ...], where: str) -> None:
        """Take ``name`` for a rule meaning ``signature`` (``where`` says who, for errors)."""
        taken = self._taken.get(name)
        if taken is None:
            self._taken[name] = (signature, where)
            return
        if taken[0] == signature:
            return
        if signature[0] == "shared" and taken[0][0] == "shared":
            raise ConfigurationError(
                f"rule {name!r} ({where}) is shared with {taken[1]} but its limits differ;"
                " shared rules must have the same limits"
            )
        raise ConfigurationError(
            f"rule name {name!r} ({where}) is already used on this pool by {taken[1]};"
            " give one of them another name=, or shared=True on both to count them together"
        )
