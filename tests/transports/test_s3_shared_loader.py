"""The S3 clients of one process share botocore's data loader (:func:`dcp_storage.transports.s3_stream.share_loader`):
a client after the first does not read and parse the service model and endpoint rules again. Checked on moto:
filesystems with different options get sessions with one loader and work; a session the caller gave, and
options botocore refuses, are left to s3fs as before."""

from __future__ import annotations

from typing import Any

import aiobotocore.session
import pytest
import s3fs

from dcp_storage.transports import FsspecTransport
from dcp_storage.transports.s3_stream import client_ready, share_loader


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
