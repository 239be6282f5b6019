from __future__ import annotations

import importlib
import inspect
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


PUBLIC_MODULES = [
    "porch",
    "porch.clock",
    "porch.errors",
    "porch.identity",
    "porch.metrics",
    "porch.pool",
    "porch.ratelimit",
    "porch.idempotency",
    "porch.store",
    "porch.integrations.starlette",
    "porch.integrations.fastapi",
    "porch.integrations.wsgi",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_is_exported_sorted_and_documented(name: str) -> None:
    """httpx's test_exported_members, for each public module: __all__ is sorted (as ruff's
    RUF022 sorts it: constants, classes, then the rest), every name in it exists, and every
    exported class and function says what it is."""
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    exported = list(module.__all__)
    order = sorted(exported, key=lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n))
    assert exported == order, f"{name}.__all__ is not sorted"
    for member in exported:
        assert hasattr(module, member), f"{name}.{member} is exported but missing"
        value = getattr(module, member)
        if callable(value) and (inspect.isclass(value) or inspect.isfunction(value)):
            assert inspect.getdoc(value), f"{name}.{member} has no docstring"
