"""Fixtures of the deploy tests: an `OpenAIService` over the in-process fakes of fakes.py."""

from __future__ import annotations

import pytest

from .fakes import MakeService, make_service


@pytest.fixture(name="make_service")
def make_service_fixture() -> MakeService:
    """`make_service(replica=None, *, limits=None, outcomes=None, **backend)` -> (service, replica)."""
    return make_service
