"""Deprecated: this module moved to :mod:`porch.integrations.fastapi`; the alias goes in 0.3."""

import warnings

from .integrations.fastapi import *  # noqa: F403
from .integrations.fastapi import __all__  # noqa: F401

warnings.warn(
    "porch.fastapi moved to porch.integrations.fastapi; import from there",
    DeprecationWarning,
    stacklevel=2,
)
