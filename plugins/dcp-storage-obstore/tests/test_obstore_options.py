"""s3fs-style storage options -> obstore S3 settings (no server needed)."""

from __future__ import annotations

import datetime

import pytest

from dcp_storage_obstore import ObstoreOptionsError, s3_settings


def test_s3fs_style_options_are_mapped() -> None:
    s = s3_settings(
        {
            "key": "AK",
            "secret": "SK",
            "token": "TK",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }
    )
    assert s.config == {
        "access_key_id": "AK",
        "secret_access_key": "SK",
        "session_token": "TK",
        "endpoint": "http://127.0.0.1:9000",
        "region": "eu-west-1",
    }
    assert s.client_options["allow_http"] is True and s.client_options["timeout"] == "300s"
    assert s.public_config()["secret_access_key"] == "***" and s.public_config()["session_token"] == "***"
    assert "SK" not in repr(s) and "TK" not in repr(s)


def test_https_endpoint_anon_and_passthrough() -> None:
    s = s3_settings(
        {
            "anon": True,
            "endpoint_url": "https://s3.example.com",
            "obstore": {"config": {"virtual_hosted_style_request": True}, "client_options": {"timeout": "5s"}},
        }
    )
    assert s.config == {
        "skip_signature": True,
        "endpoint": "https://s3.example.com",
        "virtual_hosted_style_request": True,
    }
    assert "allow_http" not in s.client_options and s.client_options["timeout"] == "5s"
    assert s3_settings(None).config == {}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"requester_pays": True}, "'requester_pays'"),
        ({"client_kwargs": {"verify": False}}, "'client_kwargs.verify'"),
        ({"obstore": {"retry": {}}}, "'obstore.retry'"),
    ],
)
def test_unmappable_options_are_refused_by_name(options: dict, named: str) -> None:
    with pytest.raises(ObstoreOptionsError, match=named) as info:
        s3_settings({"secret": "hush-hush", **options})
    assert "hush-hush" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_the_deadline_bounds_each_request_unless_the_user_set_a_timeout() -> None:
    default = s3_settings({"endpoint_url": "http://127.0.0.1:9"})
    assert default.store_kwargs("b")["client_options"]["timeout"] == "300s"
    assert default.store_kwargs("b", deadline=2.5)["client_options"]["timeout"] == datetime.timedelta(seconds=2.5)
    assert default.store_kwargs("b", deadline=900)["client_options"]["timeout"] == datetime.timedelta(seconds=300)
    own = s3_settings({"obstore": {"client_options": {"timeout": "45s"}}})
    assert own.store_kwargs("b", deadline=2.5)["client_options"]["timeout"] == "45s"
