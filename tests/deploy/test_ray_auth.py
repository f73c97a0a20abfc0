"""Ray is never open in the deployment: every Ray container and the API (a Ray node and
driver itself) run with Ray token authentication, all with the one token of a Secret the
guide creates; none of it in a ConfigMap or written into a manifest."""

from __future__ import annotations

from tests.deploy.deployfiles import GUIDE, Doc, api_container, manifests, of_kind, one, ray_pods

SECRET = ("bnrecal-ray-auth", "auth-token")


def ray_auth_problems(docs: list[Doc]) -> list[str]:
    """Containers that would run Ray without token auth, or with a token from elsewhere."""
    containers = [("api", api_container(docs))]
    for cluster in of_kind(docs, "RayCluster"):
        containers += [(role, spec["containers"][0]) for role, _, spec in ray_pods(cluster)]
    problems: list[str] = []
    for role, container in containers:
        env = {item["name"]: item for item in container.get("env", [])}
        if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
            problems.append(f"{role}: RAY_AUTH_MODE is not token")
        ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
        if (ref.get("name"), ref.get("key")) != SECRET:
            problems.append(f"{role}: RAY_AUTH_TOKEN is not the Secret {SECRET[0]} key {SECRET[1]}")
        if "RAY_AUTH_TOKEN_PATH" in env:
            problems.append(f"{role}: RAY_AUTH_TOKEN_PATH would be ignored for RAY_AUTH_TOKEN")
    for config_map in of_kind(docs, "ConfigMap"):
        leaked = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(config_map.get("data", {}))
        if leaked:
            problems.append(f"ConfigMap {config_map['metadata']['name']} sets {sorted(leaked)}")
    return problems


def test_every_ray_container_and_the_api_require_the_shared_token() -> None:
    docs = manifests()
    assert ray_auth_problems(docs) == []
    roles = {role for role, _, _ in ray_pods(one(docs, "RayCluster"))}
    assert roles >= {"head", "gpu", "cpu"}


def test_a_ray_group_without_auth_or_with_another_token_is_caught() -> None:
    docs = manifests()
    cluster = one(docs, "RayCluster")
    cpu = next(g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "cpu")
    env = cpu["template"]["spec"]["containers"][0]["env"]
    env[:] = [item for item in env if item["name"] != "RAY_AUTH_MODE"]
    api_env = api_container(docs)["env"]
    token = next(item for item in api_env if item["name"] == "RAY_AUTH_TOKEN")
    token["valueFrom"]["secretKeyRef"]["name"] = "another-secret"
    assert ray_auth_problems(docs) == [
        "api: RAY_AUTH_TOKEN is not the Secret bnrecal-ray-auth key auth-token",
        "cpu: RAY_AUTH_MODE is not token",
    ]


def test_the_guide_creates_the_token_secret_and_says_why() -> None:
    guide = GUIDE.read_text()
    assert f"kubectl create secret generic {SECRET[0]} --from-literal={SECRET[1]}=" in guide
    assert "RAY_AUTH_MODE=token" in guide and "remote code execution" in guide
