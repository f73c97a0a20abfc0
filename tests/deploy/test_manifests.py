"""The KubeRay manifests: they parse, and agree with the image (ports, entry point, user),
the code (settings, CLI flags, served paths, Ray's own flags) and each other (image,
services, claims, GPU counts, the rank bundle)."""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

import pytest
import yaml
from pydantic import AliasChoices

from bnrecal.service.settings import Settings
from tests.deploy.deployfiles import (
    DEFAULT_GCS_PORT,
    DEPLOY,
    GUIDE,
    HEAD_SERVICE_SUFFIX,
    REPO,
    VARIANTS,
    Doc,
    api_container,
    api_deployment,
    build_image,
    container_env,
    cpu_quantity,
    dry_run,
    manifest_files,
    manifests,
    of_kind,
    one,
    option_names,
    pod_specs,
    ray_cli_options,
    ray_pods,
)

GPU = "nvidia.com/gpu"


def settings_env_names() -> set[str]:
    """Every environment variable the Settings class reads (prefix + field, and aliases)."""
    names: set[str] = set()
    for name, info in Settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {str(choice) for choice in alias.choices}
        else:
            names.add(f"BNRECAL_{name.upper()}")
    return names


def served_paths() -> set[str]:
    """The paths the API's routers declare (read from the source: importing them pulls in Ray)."""
    pattern = re.compile(r"@router\.(?:get|head|post)\(\s*\"([^\"]+)\"")
    return {m for f in (REPO / "api" / "routes").glob("*.py") for m in pattern.findall(f.read_text())}


def the_cluster(docs: list[Doc]) -> Doc:
    return one(docs, "RayCluster")


def api_settings(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The Settings the API process reads from its container environment."""
    for name in list(os.environ):
        if name.startswith("BNRECAL_") or name == "RAY_ADDRESS":
            monkeypatch.delenv(name)
    for name, value in container_env(api_container(docs), docs, secret_value="key-1,key-2").items():
        monkeypatch.setenv(name, value)
    return Settings()


def mount_of(container: Doc, spec: Doc, path: str) -> tuple[str, Doc] | None:
    """The deepest volume mount holding ``path``: (mount path, its volume)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    holding = [m for m in container.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    if not holding:
        return None
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    return mount["mountPath"], volumes[mount["name"]]


# --- Checks that return the problems they find (so they can be shown to catch them) ----


def unknown_settings(docs: list[Doc]) -> list[str]:
    """BNRECAL_* variables in containers, their ConfigMaps or the image that no setting reads."""
    known = settings_env_names()
    found: set[str] = set()
    for _, spec in pod_specs(docs):
        for container in spec["containers"]:
            found |= set(container_env(container, docs))
    for doc in of_kind(docs, "ConfigMap"):
        found |= set(doc.get("data", {}))
    for variant in VARIANTS:
        found |= set(build_image(variant).env)
    return sorted(n for n in found if n.startswith("BNRECAL_") and n not in known)


def image_problems(docs: list[Doc]) -> list[str]:
    """Pods that do not all run the one image (kustomize's image entry included)."""
    images = {f"{role}/{c['name']}": c["image"] for role, spec in pod_specs(docs) for c in spec["containers"]}
    problems = [] if len(set(images.values())) == 1 else [f"different images: {images}"]
    for kustomization in of_kind(docs, "Kustomization"):
        for entry in kustomization.get("images", []):
            name, _, tag = next(iter(images.values())).rpartition(":")
            if entry["name"] != name or entry.get("newTag", tag) != tag:
                problems.append(f"kustomization image {entry} is not {name}:{tag}")
    return problems


def gpu_problems(cluster: Doc) -> list[str]:
    """Worker groups whose GPU limit and Ray's num-gpus disagree."""
    problems: list[str] = []
    for role, params, spec in ray_pods(cluster):
        resources = spec["containers"][0].get("resources", {})
        limit = int(resources.get("limits", {}).get(GPU, 0))
        request = resources.get("requests", {}).get(GPU)
        if request is not None and int(request) != limit:
            problems.append(f"{role}: {GPU} request {request} != limit {limit}")
        if int(params.get("num-gpus", "0")) != limit:
            problems.append(f"{role}: num-gpus {params.get('num-gpus')} != {GPU} limit {limit}")
    return problems


# --- Parsing and references -------------------------------------------------------------


def test_every_manifest_parses_into_named_objects() -> None:
    files = manifest_files()
    assert {f.name for f in files} >= {"raycluster.yaml", "api.yaml", "kustomization.yaml"}
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} holds no document"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: a document without apiVersion/kind"
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], f"{path}: a {doc['kind']} without a name"
    assert the_cluster(manifests())["apiVersion"] == "ray.io/v1"


def test_kustomization_applies_every_manifest() -> None:
    kustomization = one(manifests(), "Kustomization")
    folder = DEPLOY / "kuberay"
    listed = {(folder / r).resolve() for r in kustomization["resources"]}
    assert all(p.exists() for p in listed), kustomization["resources"]
    assert listed == {p.resolve() for p in folder.glob("*.yaml") if p.name != "kustomization.yaml"}


def test_references_resolve() -> None:
    docs = manifests()
    claims = {d["metadata"]["name"] for d in of_kind(docs, "PersistentVolumeClaim")}
    config_maps = {d["metadata"]["name"] for d in of_kind(docs, "ConfigMap")}
    for role, spec in pod_specs(docs):
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{role}: {volume}"
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps, f"{role}: {source}"
            names = {v["name"] for v in spec.get("volumes", [])}
            assert {m["name"] for m in container.get("volumeMounts", [])} <= names, f"{role}: unknown volume"


# --- The image and the manifests ----------------------------------------------------


def test_one_image_everywhere() -> None:
    docs = manifests()
    assert image_problems(docs) == []
    changed = manifests()
    api_container(changed)["image"] = api_container(changed)["image"].replace("-cuda", "-cpu")
    assert image_problems(changed), "an API on another image than the workers was not caught"


def test_ray_version_matches_the_image() -> None:
    """KubeRay picks its behaviour (probes, start flags) by the declared Ray version."""
    for variant in VARIANTS:
        assert the_cluster(manifests())["spec"]["rayVersion"] == build_image(variant).args["RAY_VERSION"]


def test_api_ports_agree_with_the_image_and_the_service() -> None:
    docs = manifests()
    container = api_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for variant in VARIANTS:
        image = build_image(variant)
        assert set(ports.values()) <= image.expose, f"{variant}: API ports {ports} not EXPOSEd"
        served = dry_run(container.get("args", image.cmd), {**image.env, **container_env(container, docs)})
        serve = next(c for c in served if c[:2] == ["bnrecal", "serve"])
        assert int(serve[serve.index("--port") + 1]) in ports.values(), f"{variant}: serves on another port"
    service = one(docs, "Service", "bnrecal-api")
    labels = api_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert api_deployment(docs)["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        assert ports.get(target, target) in ports.values(), f"Service port {port} reaches no container port"


def test_head_ports_are_exposed_and_ray_address_names_the_head_service() -> None:
    docs = manifests()
    cluster = the_cluster(docs)
    head_params, head_spec = next((p, s) for role, p, s in ray_pods(cluster) if role == "head")
    gcs_port = int(head_params.get("port", DEFAULT_GCS_PORT))
    head_ports = {p["containerPort"] for p in head_spec["containers"][0].get("ports", [])}
    assert gcs_port in head_ports
    for variant in VARIANTS:
        assert head_ports <= build_image(variant).expose
    address = container_env(api_container(docs), docs).get("RAY_ADDRESS")
    assert address == f"{cluster['metadata']['name']}{HEAD_SERVICE_SUFFIX}:{gcs_port}", address


def test_probes_hit_paths_the_api_serves() -> None:
    docs = manifests()
    container = api_container(docs)
    paths = served_paths()
    assert {"/healthz", "/readyz"} <= paths
    port_names = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
    probes = {kind: container[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe", "startupProbe")
              if kind in container}
    for kind, probe in probes.items():
        assert probe["path"] in paths and probe["port"] in port_names, f"{kind}: {probe}"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"


def test_pods_run_as_the_image_user() -> None:
    docs = manifests()
    uid = int(str(build_image("cuda").user).split(":")[0])
    for role, spec in pod_specs(docs):
        context = spec.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, role
        assert context.get("runAsUser", uid) == uid, f"{role}: runAsUser differs from the image's USER"


# --- Settings through the environment ------------------------------------------------


def test_every_bnrecal_variable_is_a_setting() -> None:
    docs = manifests()
    assert unknown_settings(docs) == []
    config_map = one(docs, "ConfigMap", "bnrecal-settings")
    config_map["data"]["BNRECAL_NOT_A_SETTING"] = "1"
    assert unknown_settings(docs) == ["BNRECAL_NOT_A_SETTING"]


def test_api_settings_parse_and_place_the_data_on_the_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = manifests()
    settings = api_settings(docs, monkeypatch)  # raises on any value the API would refuse
    assert settings.ray_address and settings.api_keys == ["key-1", "key-2"]
    spec = api_deployment(docs)["spec"]["template"]["spec"]
    container = api_container(docs)
    for path in [settings.data_dir, *settings.data_roots]:
        mount = mount_of(container, spec, str(path))
        assert mount and "persistentVolumeClaim" in mount[1], f"{path} is not on a persistent volume"
    for root in settings.data_roots:
        # A root holding the data dir would let a path job read another tenant's blobs.
        assert not Path(settings.data_dir).is_relative_to(root) and not root.is_relative_to(settings.data_dir)


def test_the_pod_outlives_the_shutdown_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM lets running jobs finish for the grace, then shuts down (Ray included): a pod
    # killed before that loses the jobs' requeue, which only a crash recovery then repairs.
    docs = manifests()
    grace = api_settings(docs, monkeypatch).shutdown_grace_s
    termination = api_deployment(docs)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 0 and termination >= grace + 15, (grace, termination)


def test_api_keys_come_from_a_secret_the_guide_creates() -> None:
    docs = manifests()
    assert all("BNRECAL_API_KEYS" not in d.get("data", {}) for d in of_kind(docs, "ConfigMap"))
    entry = next(e for e in api_container(docs)["env"] if e["name"] == "BNRECAL_API_KEYS")
    ref = entry["valueFrom"]["secretKeyRef"]
    assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in GUIDE.read_text()


def test_every_setting_is_documented_in_the_guide() -> None:
    guide = GUIDE.read_text()
    missing = sorted(n for n in settings_env_names() if n.startswith("BNRECAL_") and f"`{n}`" not in guide)
    assert not missing, f"deploy/README.md's settings table lacks {missing}"


def test_api_is_one_recreated_replica_without_service_links() -> None:
    deployment = api_deployment(manifests())
    assert deployment["spec"]["replicas"] == 1  # the ledger is SQLite
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    # Service links would put BNRECAL_*-prefixed variables (from Services named bnrecal-*) into
    # the environment the settings are read from.
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False


# --- Commands: the CLI and Ray's own flags --------------------------------------------


def test_the_api_command_uses_flags_the_cli_has() -> None:
    import typer

    from bnrecal.service.cli import app

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    if "serve" not in commands:
        pytest.skip("`bnrecal serve` is not registered in service.cli yet")
    known = {opt for param in commands["serve"].params for opt in param.opts}
    docs = manifests()
    container = api_container(docs)
    for variant in VARIANTS:
        image = build_image(variant)
        served = dry_run(container.get("args", image.cmd), {**image.env, **container_env(container, docs)})
        serve = next(c for c in served if c[:2] == ["bnrecal", "serve"])
        assert set(option_names(serve)) <= known, f"unknown serve flags {set(option_names(serve)) - known}"


def test_ray_commands_use_flags_ray_has() -> None:
    docs = manifests()
    container = api_container(docs)
    for program, *words in dry_run(container.get("args", ["api"]), container_env(container, docs)):
        if program == "ray":
            options = ray_cli_options(words[0])
            assert set(option_names(words)) <= set(options), f"ray {words[0]}: unknown flags in {words}"
    start = ray_cli_options("start")
    for role, params, _ in ray_pods(the_cluster(docs)):
        for key in params:
            # KubeRay passes each as --key=value, so each must be a ray start option taking a value.
            assert start.get(f"--{key}") is False, f"{role}: rayStartParams {key} is not a valued ray start option"


def test_ray_containers_leave_the_command_to_kuberay() -> None:
    for role, _, spec in ray_pods(the_cluster(manifests())):
        assert "command" not in spec["containers"][0] and "args" not in spec["containers"][0], role


# --- Resources ------------------------------------------------------------------------


def test_head_takes_no_ranks() -> None:
    head = next(params for role, params, _ in ray_pods(the_cluster(manifests())) if role == "head")
    assert head.get("num-cpus") == "0" and head.get("num-gpus", "0") == "0"


def test_gpu_groups_request_what_ray_advertises() -> None:
    cluster = the_cluster(manifests())
    assert gpu_problems(cluster) == []
    assert any(int(p.get("num-gpus", "0")) > 0 for role, p, _ in ray_pods(cluster)), "no GPU worker group"
    gpu_group = next(g for g in cluster["spec"]["workerGroupSpecs"] if int(g["rayStartParams"]["num-gpus"]) > 0)
    gpu_group["rayStartParams"]["num-gpus"] = "2"
    assert gpu_problems(cluster) == [f"{gpu_group['groupName']}: num-gpus 2 != {GPU} limit 1"]


def test_a_rank_fits_in_every_worker_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = manifests()
    settings = api_settings(docs, monkeypatch)
    assert settings.cpus_per_worker, "set BNRECAL_CPUS_PER_WORKER: the default assumes an embedded cluster"
    for role, params, spec in ray_pods(the_cluster(docs)):
        if role == "head":
            continue
        limits = spec["containers"][0]["resources"]["limits"]
        cpus = float(params.get("num-cpus", cpu_quantity(limits["cpu"])))
        assert cpus <= cpu_quantity(limits["cpu"]), f"{role}: num-cpus above the pod's CPU limit"
        assert settings.cpus_per_worker <= cpus, f"{role}: a rank's {settings.cpus_per_worker} CPUs do not fit"
        if int(params.get("num-gpus", "0")):
            assert settings.gpus_per_worker <= int(params["num-gpus"]), f"{role}: a rank's GPUs do not fit"


def test_ray_nodes_have_a_shared_memory_object_store() -> None:
    for role, spec in pod_specs(manifests()):
        mounts = {m["mountPath"]: m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert "/dev/shm" in mounts, f"{role}: no /dev/shm mount (Ray's object store)"
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", role
