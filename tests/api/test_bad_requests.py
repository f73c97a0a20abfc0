"""Bad requests at the front door, each a problem+json 4xx that says what is wrong: numbers
sent as booleans or strings, ``model_kwargs`` keys that cannot be argument names, bodies
that are not UTF-8 or nest too deep, headers too large for the server, and calibration data
with NaN or inf in it."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.routing import APIRoute

from bnrecal.api.json_body import JsonBodyRoute
from bnrecal.api.routes import blobs, health, jobs, pages
from tests.api.conftest import LiveServer, submit, upload, wait_for
from tests.api.server_process import ServerProcess, servers  # noqa: F401 - servers is a fixture
from tests.conftest import save_state
from tests.nets import mixed_net

pytestmark = pytest.mark.usefixtures("ray_cluster")

UNKNOWN_BLOBS = {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}
"""A spec whose fields are all valid and whose blobs do not exist: past validation, it is refused
naming ``checkpoint``, so a 422 naming another field means that field was refused."""


def post_spec(live_server: LiveServer, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit ``spec``; the problem+json 422 it must get back."""
    with live_server.client("errors") as client:
        response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return response.json()


@pytest.mark.parametrize(
    ("change", "field", "sent"),
    [
        ({"workers": True}, "workers", "got true"),
        ({"workers": "2"}, "workers", 'got the string "2"'),
        ({"batch_size": 32.0}, "batch_size", "got the number 32.0"),
        ({"max_samples": "10"}, "max_samples", 'got the string "10"'),
        ({"max_retries": False}, "max_retries", "got false"),
        ({"onnx": {"opset": "18"}}, "onnx.opset", 'got the string "18"'),
        ({"onnx": {"input_shape": [3, True, 5]}}, "onnx.input_shape.1", "got true"),
        ({"onnx": {"dynamic_batch": "yes"}}, "onnx.dynamic_batch", 'got the string "yes"'),
        ({"eval": {"data": "sha256:" + "2" * 64, "max_samples": True}}, "eval.max_samples", "got true"),
    ],
)
def test_a_number_or_flag_sent_as_another_json_type_is_refused_naming_the_field(live_server, change, field, sent):
    problem = post_spec(live_server, UNKNOWN_BLOBS | change)
    assert problem["field"] == field and problem["type"].endswith("/validation")
    assert problem["detail"].startswith(f"{field}: Input should be a valid ") and problem["detail"].endswith(sent)


def test_json_integers_and_booleans_are_still_accepted(live_server):
    spec = UNKNOWN_BLOBS | {"workers": 2, "batch_size": 8, "max_retries": 0, "onnx": {"opset": 17, "dynamic_batch": False}}
    problem = post_spec(live_server, spec)
    assert problem["field"] == "checkpoint"  # every other field passed


@pytest.mark.parametrize(
    ("kwargs", "field", "why"),
    [
        ({"__class__": "x"}, "model_kwargs.__class__", "a reserved (dunder) name"),
        ({"channels": 6, "class": 3}, "model_kwargs.class", "a Python keyword"),
        ({"num-classes": 3}, "model_kwargs.num-classes", "not an argument name"),
        ({"config": {"a": [[[[[[[[1]]]]]]]]}}, "model_kwargs.config", "deeper than 8 levels"),
    ],
)
def test_model_kwargs_no_factory_could_take_are_refused_at_submission(live_server, kwargs, field, why):
    problem = post_spec(live_server, UNKNOWN_BLOBS | {"model_kwargs": kwargs})
    assert problem["field"] == field and problem["type"].endswith("/spec")
    assert why in problem["detail"]


@pytest.mark.parametrize(
    ("body", "reason", "where"),
    [
        (b'{"arch": "torchvision:resnet\xff"}', "byte 0xff is not UTF-8 (a JSON body must be UTF-8)", "line 1 column 29"),
        (b'{\n  "arch": "caf\xc3\xa9",\n  "data": "\xe9t\xe9"\n}', "byte 0xe9 is not UTF-8", "line 3 column 12"),
        (("[" * 5000 + "]" * 5000).encode(), "arrays and objects nest deeper than 32 levels", "line 1 column 33"),
        (b'{"model_kwargs": {"a": "[[[[", "b": ' + b"[" * 40 + b"]" * 40 + b"}}",
         "arrays and objects nest deeper than 32 levels", "line 1 column 67"),
    ],
)
def test_a_body_not_utf8_or_nested_too_deep_is_422_saying_where(live_server, body, reason, where):
    with live_server.client("errors") as client:
        response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"].endswith("/validation") and problem["field"] is None
    assert problem["detail"].startswith(f"the request body is not valid JSON: {reason}")
    assert problem["detail"].endswith(f" at {where}")


def test_a_utf8_body_with_a_byte_order_mark_or_nested_to_the_limit_is_read(live_server):
    nested = {"model_kwargs": {"config": {"a": [[[[[[1]]]]]]}}}  # 9 levels: within both limits
    for body in (json.dumps(UNKNOWN_BLOBS).encode("utf-8-sig"), json.dumps(UNKNOWN_BLOBS | nested).encode()):
        with live_server.client("errors") as client:
            response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422 and response.json()["field"] == "checkpoint", response.text


def test_every_operation_that_takes_a_json_body_reads_it_strictly():
    routes = [route for module in (blobs, health, jobs, pages) for route in module.router.routes]
    with_body = [route for route in routes if isinstance(route, APIRoute) and route.body_field is not None]
    assert {route.path for route in with_body} >= {"/v1/jobs"}
    assert all(isinstance(route, JsonBodyRoute) for route in with_body), [r.path for r in with_body]


def test_headers_over_the_server_limit_are_431_the_client_receives(live_server):
    huge = "Bearer " + "k" * 1_000_000
    for _ in range(5):  # the reset it replaces was a race the client lost nearly every time
        with httpx.Client(base_url=live_server.url, timeout=30) as client:
            response = client.get("/v1/jobs", headers={"Authorization": huge})
        assert response.status_code == 431 and response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["type"].endswith("/headers-too-large") and problem["status"] == 431
        assert problem["detail"].startswith("the request's headers are over the server's limit of 16384 bytes")
        assert "(the Authorization header alone is at least " in problem["detail"]
    with live_server.client("errors") as client:  # the server goes on serving
        assert client.get("/v1/jobs").status_code == 200


def test_a_request_that_is_not_http_is_400_problem_json(live_server):
    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nthis is no header\r\n\r\n")
        received = b""
        while chunk := raw.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/problem+json" in head.lower()
    problem = json.loads(body)
    assert problem["status"] == 400 and problem["type"].endswith("/input")
    assert problem["detail"].startswith("the request is not valid HTTP/1.1: ")


def test_bnrecal_serve_answers_oversized_headers_and_bad_bodies_the_same_way(servers, tmp_path):  # noqa: F811 - the imported fixture
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    servers.append(server)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        too_large = client.get("/v1/jobs", headers={"Authorization": "Bearer " + "k" * 1_000_000})
    assert too_large.status_code == 431 and too_large.headers["content-type"] == "application/problem+json"
    not_utf8 = server.client.post("/v1/jobs", content=b'{"arch": "\xff"}', headers={"Content-Type": "application/json"})
    assert not_utf8.status_code == 422 and not_utf8.json()["detail"].endswith(" at line 1 column 11")


def test_non_finite_calibration_data_fails_the_job_as_bad_data_naming_layer_and_samples(live_server, tmp_path):
    samples = torch.randn(8, 3, 6, 5)
    samples[6, 0, 1, 1] = float("nan")  # step 1 (samples 4-7) of batch 4; with 2 ranks, rank 1's slice 6-7
    np.save(tmp_path / "x.npy", samples.numpy())
    with live_server.client("errors") as client:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, save_state(tmp_path / "m.pt", mixed_net())),
                "data": upload(client, tmp_path / "x.npy"), "workers": 2, "batch_size": 4, "order": "given"}
        job = wait_for(client, submit(client, spec)["id"])
    assert job["status"] == "failed"
    error = job["error"]
    assert error["type"].endswith("/dataset") and error["status"] == 422 and error["title"] == "Invalid calibration data"
    first = "BN layer 'bn' (BatchNorm2d) in step 1"
    assert error["detail"] in (  # the rank holding the sample names it; its peer, whichever reports first, the step
        (f"calibration sample 6 has non-finite values (NaN or inf), first seen by {first} (samples 6-7): "
         "fix or leave out that sample"),
        (f"non-finite values (NaN or inf) first reached {first} (samples 4-7): check those samples of the "
         "calibration data (values too large for float32?) and the checkpoint's weights"),
    ), error["detail"]
