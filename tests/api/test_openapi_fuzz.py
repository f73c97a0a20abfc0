"""schemathesis against the live server's ``/openapi.json``: generated requests never get a 5xx.

Valid and invalid requests for every operation, a bounded number of each, with and
without an API key. (schemathesis's own pytest plugin needs pytest < 9, so the cases
are drawn from its per-operation strategies with hypothesis directly.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from tests.api.conftest import KEYS

pytestmark = pytest.mark.usefixtures("ray_cluster")

EXAMPLES = 8


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
                    response = case.call(base_url=live_server.url, headers=headers, timeout=30)
                    seen.append((operation.label, response.status_code))
                    assert response.status_code < 500, f"{operation.label}: {response.text[:300]}"
                    if response.status_code >= 400 and case.method.upper() != "HEAD":
                        content_type = response.headers.get("content-type") or [""]
                        assert content_type[0] == "application/problem+json", response.text[:200]

            try:
                no_server_error()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE, operation.label
                skipped.append(operation.label)

    assert set(skipped) <= {"GET /healthz", "GET /readyz", "GET /metrics"}
    statuses = {status for _, status in seen}
    assert 401 in statuses and 422 in statuses and any(200 <= s < 300 for s in statuses)
