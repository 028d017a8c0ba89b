"""The S3 clients of one process share botocore's data loader (:func:`dcp_storage.transports.s3_stream.share_loader`):
a client after the first does not read and parse the service model and endpoint rules again. Checked on moto:
filesystems with different options get sessions with one loader and work; a session the caller gave, and
options botocore refuses, are left to s3fs as before. The loader is the quicker kind (no listing of every
service folder, plain-dict JSON): it loads what botocore's own loads, in the same order."""

from __future__ import annotations

import json
from typing import Any

import aiobotocore.session
import pytest
import s3fs

from dcp_storage.transports import FsspecTransport
from dcp_storage.transports.s3_stream import client_ready, model_loader, share_loader


def _fs(options: dict[str, Any], **more: Any) -> Any:
    return s3fs.S3FileSystem(**{**options, "skip_instance_cache": True, **more})


def test_clients_with_other_options_share_one_loader_and_work(s3_url: Any) -> None:
    url, options = s3_url
    transport, root = FsspecTransport.from_url(url, options)
    with transport:
        transport.write_file(transport.join(root, "x"), b"abc")
    first, second = _fs(options), _fs(options, default_block_size=1 << 20)
    for fs in (first, second):
        client_ready(fs)
    loaders = [fs.session.get_component("data_loader") for fs in (first, second)]
    assert loaders[0] is loaders[1]
    assert "service-2" in str(loaders[0]._cache), "the first client left its model in the shared loader"
    for fs in (first, second):
        assert fs.cat_file(f"{url.removeprefix('s3://')}/x") == b"abc"
        assert fs._session_is_owned  # refresh=True still makes a new session, as for one s3fs made


def test_a_session_the_caller_gave_is_kept(s3_url: Any) -> None:
    _url, options = s3_url
    given = aiobotocore.session.AioSession()
    fs = _fs(options, session=given)
    client_ready(fs)
    assert fs.session is given and not fs._session_is_owned


def test_a_client_already_built_is_left_alone(s3_url: Any) -> None:
    _url, options = s3_url
    fs = _fs(options)
    client_ready(fs)
    session = fs.session
    fs.session = None
    share_loader(fs)  # the client exists: nothing to share any more
    assert fs.session is None
    fs.session = session


def test_a_profile_botocore_cannot_find_fails_as_without_sharing(s3_url: Any) -> None:
    _url, options = s3_url
    options = {k: v for k, v in options.items() if k not in ("key", "secret", "token")}
    errors = []
    for share in (True, False):
        fs = _fs(options, profile="no-such-profile-here")
        if share:
            share_loader(fs)
            assert fs.session is None  # botocore refused the profile: s3fs makes (and refuses) its own
        with pytest.raises(Exception) as caught:
            client_ready(fs)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


# ------------------------------------------------------------------ the quicker loader (s3_stream.model_loader)
def _as_botocore(loader: Any, call: str, *args: str) -> tuple[str, str]:
    from botocore.loaders import create_loader

    plain = create_loader()
    return json.dumps(getattr(loader, call)(*args)), json.dumps(getattr(plain, call)(*args))


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("load_service_model", ("s3", "service-2")),
        ("load_service_model", ("s3", "endpoint-rule-set-1")),
        ("load_data", ("endpoints",)),
        ("load_data", ("partitions",)),
    ],
)
def test_the_quick_loader_loads_what_botocore_loads_in_its_order(call: str, args: tuple[str, ...]) -> None:
    loader = model_loader(None)
    assert type(loader).__name__ == "_ModelLoader", "this botocore is the one the quick loader was written for"
    ours, botocores = _as_botocore(loader, call, *args)
    assert ours == botocores


def test_an_unknown_service_raises_botocores_own_error() -> None:
    from botocore.exceptions import UnknownServiceError

    with pytest.raises(UnknownServiceError, match="no-such-service"):
        model_loader(None).load_service_model("no-such-service", "service-2")


def test_a_data_path_is_searched_first_and_its_latest_version_taken(tmp_path: Any) -> None:
    for version, title in (("2020-01-01", "old"), ("2024-01-01", "new")):
        folder = tmp_path / "s3" / version
        folder.mkdir(parents=True)
        (folder / "service-2.json").write_text(json.dumps({"metadata": {"title": title}, "shapes": {}}))
    loader = model_loader(str(tmp_path))
    assert loader.load_service_model("s3", "service-2")["metadata"] == {"title": "new"}
    assert loader.load_service_model("s3", "service-2", "2020-01-01")["metadata"] == {"title": "old"}


def test_a_failing_shortcut_leaves_the_work_to_botocore(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = model_loader(None)
    find_extras, failed = loader._find_extras, []

    def broken_once(*args: Any) -> Any:  # the shortcut's call fails; botocore's own call, after it, works
        if not failed:
            failed.append(args)
            raise RuntimeError("a botocore this was not written for")
        return find_extras(*args)

    monkeypatch.setattr(loader, "_find_extras", broken_once)
    calls = []
    monkeypatch.setattr(loader, "list_available_services", lambda t: calls.append(t) or ["s3"])
    assert loader.load_service_model("s3", "service-2")["metadata"]["serviceId"] == "S3"
    assert calls == ["service-2"], "botocore's own method ran"


@pytest.mark.parametrize("name", ["s3/", "./s3", "../data/s3"])
def test_a_service_name_that_is_a_path_is_refused_as_botocore_refuses_it(name: str) -> None:
    from botocore.exceptions import UnknownServiceError

    with pytest.raises(UnknownServiceError):
        model_loader(None).load_service_model(name, "service-2")


def test_an_empty_data_path_searches_what_botocores_loader_searches() -> None:
    from botocore.loaders import create_loader

    assert model_loader("").search_paths == create_loader("").search_paths
