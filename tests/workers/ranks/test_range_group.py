"""INT8 ranges gathered by real Ray ranks: the same file, byte for byte, for K = 1, 2, 4
(one rank with an empty shard at the last step), equal to the one-process result, one
collective per pass on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from bnrecal.workers.ranks.group import GroupOptions
from bnrecal.workers.ranks.int8_ranges import RangeRequest
from bnrecal.workers.ranks.range_group import run_range_group

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import prepare, tensors_data, write_qdq
from bnrecal.service.run.int8 import in_process
from tests.service.export.int8_helpers import array_dataset, fp32_export

SAMPLES, BATCH = 41, 16  # the last step has one sample: ranks 1..K-1 take an empty slice


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_int8_file_is_byte_identical_for_any_number_of_ranks(tmp_path, warm_pool, method):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    samples = torch.randn(SAMPLES, 3, 24, 24)
    prepared = prepare(fp32_export(model, samples, tmp_path / "fp32.onnx"))
    dataset = array_dataset(tmp_path / "x.npy", samples)
    options = Int8Options(method=method)
    request = RangeRequest(prepared.tensors, method, options.histogram_bins() if method != "minmax" else 0,
                           options.absolute)

    def file_of(gathered) -> bytes:
        result = gathered.result
        return write_qdq(prepared, tensors_data(result.ranges, result.histograms, result.edges, options), options, [])

    here = in_process(dataset, BATCH)(prepared.model, request)
    files = {0: file_of(here)}
    passes = 1 if method == "minmax" else 2
    for world in (1, 2, 4):
        gathered = run_range_group(
            prepared.model, request, dataset, BATCH, world, "cpu", "gloo", GroupOptions(cpus_per_worker=1),
            pool=warm_pool,
        )
        assert gathered.collectives == [passes] * world
        assert sum(gathered.samples) == SAMPLES
        assert np.array_equal(gathered.result.ranges.low, here.result.ranges.low)
        if here.result.histograms is not None:
            assert np.array_equal(gathered.result.histograms, here.result.histograms)
        files[world] = file_of(gathered)
    assert len(set(files.values())) == 1
