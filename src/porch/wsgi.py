"""Deprecated: this module moved to :mod:`porch.integrations.wsgi`; the alias goes in 0.3."""

import warnings

from .integrations.wsgi import *  # noqa: F403
from .integrations.wsgi import __all__  # noqa: F401

warnings.warn(
    "porch.wsgi moved to porch.integrations.wsgi; import from there",
    DeprecationWarning,
    stacklevel=2,
)
