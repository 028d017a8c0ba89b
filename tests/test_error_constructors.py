"""Error constructors: ``FileTooLargeError`` takes a message like its parent, or its fields by keyword, and
pickles either way (DCP gathers rank errors by pickle)."""

from __future__ import annotations

import pickle

import pytest

import dcp_storage as ds


def test_file_too_large_takes_a_message_like_its_parent() -> None:
    error = ds.errors.FileTooLargeError("index.json is too large")
    assert str(error) == "index.json is too large" and error.limit is None
    assert isinstance(error, ds.errors.CorruptCheckpointError) and isinstance(error, ValueError)


def test_file_too_large_fields_by_position_or_keyword() -> None:
    positional = ds.errors.FileTooLargeError("s3://b/.metadata", 10, 4, "metadata", "raise the limit")
    keywords = ds.errors.FileTooLargeError(
        url="s3://b/.metadata", size=10, limit=4, what="metadata", fix="raise the limit"
    )
    assert str(positional) == str(keywords)
    assert "is 10 bytes, more than the 4-byte limit for metadata" in str(keywords)
    unknown = ds.errors.FileTooLargeError(url="x", limit=4)
    assert "has more than 4 bytes" in str(unknown)


@pytest.mark.parametrize(
    "error",
    [
        ds.errors.FileTooLargeError("message"),
        ds.errors.FileTooLargeError(url="u", size=None, limit=3),
        ds.errors.CorruptCheckpointError("m"),
    ],
)
def test_errors_pickle(error: Exception) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
