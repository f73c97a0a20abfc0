"""The replicated overlay (deploy/kuberay-replicated): N rolled API replicas on a Postgres
ledger and object-storage blobs from a Secret the guide creates, no shared claim; the base
single-replica SQLite variant stays as it is."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from bnrecal.service.settings import Settings
from tests.deploy.deployfiles import (
    GUIDE,
    REPLICATED,
    api_container,
    api_deployment,
    container_env,
    manifests,
    of_kind,
    pod_specs,
    replicated_manifests,
)
from tests.deploy.test_manifests import unknown_settings


def test_the_api_runs_as_rolled_replicas():
    deployment = api_deployment(replicated_manifests())
    assert deployment["spec"]["replicas"] >= 2
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    assert api_deployment(manifests())["spec"]["strategy"]["type"] == "Recreate"  # the base stays SQLite's


def test_no_replica_mounts_a_claim_the_others_cannot_share():
    docs = replicated_manifests()
    assert of_kind(docs, "PersistentVolumeClaim") == []
    for role, spec in pod_specs(docs):
        names = {volume["name"] for volume in spec.get("volumes", [])}
        assert all("persistentVolumeClaim" not in volume for volume in spec.get("volumes", [])), role
        for container in spec["containers"]:
            assert {mount["name"] for mount in container.get("volumeMounts", [])} <= names, role


def test_the_ledger_and_blob_store_come_from_a_secret_the_guide_creates(monkeypatch: pytest.MonkeyPatch):
    docs = replicated_manifests()
    refs = {
        entry["name"]: entry["valueFrom"]["secretKeyRef"]
        for entry in api_container(docs)["env"] if "secretKeyRef" in entry.get("valueFrom", {})
    }
    guide = GUIDE.read_text()
    for name in ("BNRECAL_DATABASE_URL", "BNRECAL_BLOB_STORE"):
        assert not refs[name].get("optional"), name
        assert f"kubectl create secret generic {refs[name]['name']}" in guide
        assert f"--from-literal={refs[name]['key']}=" in guide
    for name in list(os.environ):
        if name.startswith("BNRECAL_") or name == "RAY_ADDRESS":
            monkeypatch.delenv(name)
    env = container_env(api_container(docs), docs)
    env |= {"BNRECAL_DATABASE_URL": "postgresql+psycopg://u:p@db/bnrecal", "BNRECAL_BLOB_STORE": "s3://bucket/x"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.database_url.startswith("postgresql") and settings.blob_store == "s3://bucket/x"
    assert settings.data_roots == [] and settings.job_lease_s == 30.0
    assert unknown_settings(docs) == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")
def test_kustomize_renders_the_overlay_as_these_tests_read_it():
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPLICATED)], check=False, capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    ours = {(d["kind"], d["metadata"]["name"]): d for d in replicated_manifests() if d["kind"] != "Kustomization"}
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert set(theirs) == set(ours)
    for key, doc in theirs.items():
        assert doc.get("spec") == ours[key].get("spec") and doc.get("data") == ours[key].get("data"), key
