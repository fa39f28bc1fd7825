"""Fixtures of the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hf_kvgov.kernels import dispatch


@pytest.fixture
def clean_dispatch() -> Iterator[None]:
    """The automatic backend choice and zero counts before the test, the automatic choice after it."""
    dispatch.set_backend(None)
    dispatch.reset_backend_counts()
    yield
    dispatch.set_backend(None)
