import pytest

from bnrecal.workers.engine.memory_format import rank_layout


@pytest.mark.parametrize(
    ("setting", "dims", "layout"),
    [
        ("auto", 4, "channels_last"),
        ("auto", 5, "channels_last"),
        ("auto", 2, "contiguous"),
        ("auto", 3, "contiguous"),
        ("contiguous", 4, "contiguous"),
        ("channels_last", 4, "channels_last"),
        ("channels_last", 2, "contiguous"),
    ],
)
def test_rank_layout(setting, dims, layout):
    assert rank_layout(setting, dims) == layout


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="memory format must be one of"):
        rank_layout("nhwc", 4)
