"""``KeepPolicy``: which complete steps survive; the newest always does."""

from __future__ import annotations

import pytest

from dcp_storage import KeepPolicy


def test_last_k() -> None:
    assert KeepPolicy(last=2).delete([10, 20, 30, 40]) == [10, 20]
    assert KeepPolicy(last=5).delete([10, 20]) == []
    assert KeepPolicy(last=1).delete([3, 1, 2]) == [1, 2]


def test_every_n_kept_beside_the_last() -> None:
    assert KeepPolicy(last=1, every=100).delete([50, 100, 150, 200, 250]) == [50, 150]


def test_keep_everything() -> None:
    assert KeepPolicy(last=None).delete([1, 2, 3]) == []


def test_best_by_metric() -> None:
    metrics = {1: {"loss": 0.5}, 2: {"loss": 0.1}, 3: {"loss": 0.9}, 4: {"loss": 0.7}, 5: {}}
    policy = KeepPolicy(last=1, best=1, metric="loss", mode="min")
    assert policy.delete([1, 2, 3, 4, 5], metrics) == [1, 3, 4]  # 2 is best, 5 is newest
    maximise = KeepPolicy(last=1, best=2, metric="loss", mode="max")
    assert maximise.delete([1, 2, 3, 4, 5], metrics) == [1, 2]


def test_newest_is_never_deleted_even_without_metric() -> None:
    policy = KeepPolicy(last=1, best=1, metric="loss")
    assert policy.delete([1, 2], {1: {"loss": 0.0}, 2: {"loss": float("nan")}}) == []
    assert policy.keep([]) == set()


@pytest.mark.parametrize(
    "kwargs",
    [{"last": 0}, {"last": -1}, {"every": 0}, {"last": True}, {"best": 1}, {"metric": "loss"}, {"mode": "median"}],
)
def test_bad_policies_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        KeepPolicy(**kwargs)
