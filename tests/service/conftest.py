"""One in-process server for the service tests of a session (tests that need their own
server, or a subprocess, start one themselves)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.helpers import InProcessServer


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    served = InProcessServer(tmp_path_factory.mktemp("serve"))
    yield served
    served.close()
