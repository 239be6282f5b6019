from __future__ import annotations

import importlib
import sys

import pytest

import porch
import porch.errors


def test_public_surface_is_pinned() -> None:
    # A change here is a change to porch's public API: make it on purpose.
    assert sorted(porch.__all__) == sorted(
        [
            "CallerScope",
            "ClientIdentity",
            "Clock",
            "Concurrency",
            "ConfigurationError",
            "Durability",
            "Exemption",
            "ForwardingHeaderError",
            "IdempotencyMiddleware",
            "IdempotencyPolicy",
            "IdempotencyRule",
            "IntegrityError",
            "JSONFingerprint",
            "KeyFunc",
            "KeyInProgressError",
            "KeyPool",
            "KeyReusedError",
            "Limit",
            "Mailbox",
            "MailboxStatistics",
            "ManualClock",
            "Plans",
            "PolicyState",
            "PoolClosedError",
            "PoolStatistics",
            "PorchError",
            "PorchMetrics",
            "Quota",
            "QuotaFullError",
            "RateLimitExceeded",
            "RateLimitMiddleware",
            "Refusal",
            "RefusalFactory",
            "Rule",
            "SQLiteStore",
            "SaturatedError",
            "ScopeFunc",
            "Store",
            "StoreError",
            "StoreStatistics",
            "StoredResponse",
            "SystemClock",
            "UnidentifiedCallerError",
            "__version__",
            "authorization_scope",
            "idempotent_function",
            "open_store",
        ]
    )
    for name in porch.__all__:
        assert hasattr(porch, name), name


def test_framework_glue_surface_is_pinned() -> None:
    import porch.integrations.fastapi
    import porch.integrations.starlette

    assert sorted(porch.integrations.starlette.__all__) == [
        "RateLimitExceeded",
        "idempotent",
        "install",
        "limit",
    ]
    assert sorted(porch.integrations.fastapi.__all__) == [
        "Idempotency",
        "RateLimit",
        "RateLimitExceeded",
        "idempotent",
        "install",
        "limit",
    ]
    assert issubclass(porch.integrations.starlette.RateLimitExceeded, porch.RateLimitExceeded)


@pytest.mark.parametrize("name", ["starlette", "fastapi", "wsgi"])
def test_moved_modules_keep_a_deprecated_alias(name: str) -> None:
    """porch.starlette, porch.fastapi and porch.wsgi moved under porch.integrations: the old
    names still import, with a DeprecationWarning, for one release."""
    sys.modules.pop(f"porch.{name}", None)
    with pytest.warns(DeprecationWarning, match=f"porch.integrations.{name}"):
        alias = importlib.import_module(f"porch.{name}")
    moved = importlib.import_module(f"porch.integrations.{name}")
    assert alias.__all__ == moved.__all__
    for exported in moved.__all__:
        assert getattr(alias, exported) is getattr(moved, exported)


def test_every_error_says_when_it_is_raised() -> None:
    for name in porch.errors.__all__:
        error = getattr(porch.errors, name)
        assert issubclass(error, porch.PorchError)
        assert error.__doc__ is not None
        assert error.__doc__.startswith("Raised when"), name


def test_configuration_error_is_a_value_error() -> None:
    assert issubclass(porch.ConfigurationError, ValueError)
