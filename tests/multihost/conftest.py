"""Multi-host test fixtures."""
from __future__ import annotations

import pytest

from tests.conftest import fresh_postgres_database


@pytest.fixture
def pg_database():
    with fresh_postgres_database() as (name, url):
        yield name, url
