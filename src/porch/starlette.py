"""Deprecated: this module moved to :mod:`porch.integrations.starlette`; the alias goes in 0.3."""

import warnings

from .integrations.starlette import *  # noqa: F403
from .integrations.starlette import __all__  # noqa: F401

warnings.warn(
    "porch.starlette moved to porch.integrations.starlette; import from there",
    DeprecationWarning,
    stacklevel=2,
)
