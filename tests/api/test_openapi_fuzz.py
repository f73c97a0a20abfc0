"""schemathesis against the live server's ``/openapi.json``: generated requests never get a 5xx.

Valid and invalid requests for every operation, a bounded number of each, with and
without an API key. (schemathesis's own pytest plugin needs pytest < 9, so the cases
are drawn from its per-operation strategies with hypothesis directly.)
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from tests.api.conftest import KEYS

pytestmark = pytest.mark.usefixtures("ray_cluster")

EXAMPLES = 8


def call(case, base_url: str, headers: dict[str, str]) -> tuple[int, str, str]:
    """Send a generated request: its status, content type and body. An event stream that
    opens (200, text/event-stream) is checked by its status and headers and closed: it
    would run until the client leaves, by design."""
    kwargs = case.as_transport_kwargs(base_url=base_url, headers=headers)
    with requests.request(**kwargs, stream=True, timeout=30) as response:
        content_type = response.headers.get("content-type", "").split(";")[0]
        if response.status_code == 200 and content_type == "text/event-stream":
            return response.status_code, content_type, ""
        return response.status_code, content_type, response.text


def test_generated_requests_get_no_server_error(live_server):
    schema = schemathesis.openapi.from_url(f"{live_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)]
    assert len(operations) >= 10, "every operation of the API should be in the schema"
    seen: list[tuple[str, int]] = []
    skipped: list[str] = []

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def no_server_error(case) -> None:
                for headers in ({"Authorization": f"Bearer {KEYS['fuzz']}"}, {}):
                    status, content_type, text = call(case, live_server.url, headers)
                    seen.append((operation.label, status))
                    assert status < 500, f"{operation.label}: {text[:300]}"
                    if status >= 400 and case.method.upper() != "HEAD":
                        assert content_type == "application/problem+json", text[:200]

            try:
                no_server_error()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE, operation.label
                skipped.append(operation.label)

    assert set(skipped) <= {"GET /healthz", "GET /readyz", "GET /metrics"}
    statuses = {status for _, status in seen}
    assert 401 in statuses and 422 in statuses and any(200 <= s < 300 for s in statuses)
