"""The hostile corpus, written once per session (about half a second) into a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from .corpus import Case, build_corpus


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="session")
def corpus(corpus_root: Path) -> list[Case]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        return build_corpus(corpus_root)
