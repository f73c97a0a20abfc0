"""A job the cluster as it is could never place is refused at submission, naming the field."""

from __future__ import annotations

import pytest
import ray

from bnrecal.errors import SpecError
from bnrecal.service.jobserver.problems import http_status

from bnrecal.service.jobserver.cluster.capacity import Node, check_fits, check_fits_cluster, cluster_nodes
from bnrecal.service.run.options import RunOptions
from bnrecal.service.run.recalibrate import rank_resources
from bnrecal.service.settings import Settings

TWO_NODES = [Node(cpus=8, gpus=1), Node(cpus=4, gpus=0)]


def options(**fields: object) -> RunOptions:
    return RunOptions.model_validate({"arch": "tests.nets:mixed_net"} | fields)


def refusal(nodes: list[Node], cpus: float, gpus: float, **fields: object) -> SpecError:
    with pytest.raises(SpecError) as caught:
        check_fits(options(**fields), Settings(), nodes, cpus, gpus)
    return caught.value


def test_a_node_holds_as_many_ranks_as_its_scarcest_resource_allows() -> None:
    assert Node(8, 1).bundles(2, 0) == 4
    assert Node(8, 1).bundles(2, 1) == 1
    assert Node(8, 0).bundles(2, 1) == 0
    assert Node(1.5, 0).bundles(0.5, 0) == 3  # fractions count exactly
    assert Node(3, 0).bundles(4, 0) == 0


def test_ranks_that_fit_the_nodes_pass_under_every_placement() -> None:
    for placement in ("spread", "pack"):
        check_fits(options(workers=6, placement=placement), Settings(), TWO_NODES, 2, 0)  # 4 + 2
    check_fits(options(workers=4, placement="strict_pack"), Settings(), TWO_NODES, 2, 0)
    check_fits(options(workers=2, placement="strict_spread"), Settings(), TWO_NODES, 2, 0)
    check_fits(options(workers=1, device="cuda"), Settings(), TWO_NODES, 2, 1)


def test_more_ranks_than_the_cluster_holds_names_workers_and_what_it_has() -> None:
    error = refusal(TWO_NODES, 2, 0, workers=7)
    assert error.field == "workers" and http_status(error) == 422
    assert "7 ranks of 2 CPUs each need 14 CPUs" in error.message
    assert "the cluster has 12 CPUs and 1 GPUs on 2 node(s), room for 6 such ranks" in error.message
    assert "at most 6 workers" in error.message and "BNRECAL_CAPACITY_CHECK" in error.message
    # 12 CPUs in all, but 5-CPU ranks fit only on the 8-CPU node, once
    assert "room for 1 such ranks" in refusal(TWO_NODES, 5, 0, workers=2).message


def test_cuda_without_gpus_and_too_many_gpu_ranks_name_device_and_workers() -> None:
    error = refusal([Node(8, 0)], 2, 1, device="cuda")
    assert error.field == "device" and "cuda, but the cluster has no GPU" in error.message
    error = refusal(TWO_NODES, 2, 1, device="cuda", workers=2)
    assert error.field == "workers" and "2 CPUs and 1 GPUs each need 4 CPUs and 2 GPUs" in error.message
    error = refusal(TWO_NODES, 2, 2, device="cuda")  # BNRECAL_GPUS_PER_WORKER=2 on 1-GPU nodes
    assert error.field == "device" and "BNRECAL_GPUS_PER_WORKER" in error.message and "at most 8 CPUs and 1 GPUs" in error.message


def test_a_rank_larger_than_every_node_names_the_cpus_setting() -> None:
    error = refusal(TWO_NODES, 16, 0)
    assert error.field == "workers" and "each rank takes 16 CPUs (BNRECAL_CPUS_PER_WORKER)" in error.message


def test_strict_placements_count_one_node_or_nodes_with_room() -> None:
    error = refusal(TWO_NODES, 2, 0, workers=5, placement="strict_pack")
    assert error.field == "placement" and "the largest holds 4" in error.message
    error = refusal(TWO_NODES, 6, 0, workers=2, placement="strict_spread")
    assert error.field == "placement" and "1 node(s) have room" in error.message


def test_the_cluster_is_read_from_ray_and_the_check_can_be_turned_off(ray_cluster: None) -> None:
    nodes = cluster_nodes()
    assert sum(node.cpus for node in nodes) == ray.cluster_resources()["CPU"]
    settings = Settings()
    too_many = options(workers=1024)
    cpus, _ = rank_resources(settings, too_many)
    assert cpus * 1024 > ray.cluster_resources()["CPU"]
    with pytest.raises(SpecError, match="workers: 1024 ranks"):
        check_fits_cluster(too_many, settings)
    check_fits_cluster(too_many, Settings(capacity_check=False))  # an autoscaling cluster: accepted
    check_fits_cluster(options(workers=1), settings)
