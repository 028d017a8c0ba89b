"""Credentials in ``storage_options`` never leak: a sentinel secret, searched for everywhere it could show.

The storage options for the moto S3 server carry sentinel values for ``key``, ``secret`` and ``token``
(s3fs takes no connection string; the redaction helpers are checked with one). They go through save, load, ``open_reader``, ``describe``, ``verify --deep``,
``convert`` (to safetensors and to ``torch.save``) and error paths (a wrong bucket, an unreachable
endpoint, an unsafe checkpoint), and must not appear in: exception messages, reprs and chained causes
(tracebacks included), log records of any logger at DEBUG (botocore logs every signed request there), the
CLI's stdout/stderr (``--json``, ``--debug``, a malformed ``--storage-option``), the ``repr()`` of readers,
writers, transports and filesystems, or any file the checkpoint consists of.
"""

from __future__ import annotations

import logging
import pickle
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.transports import RetryPolicy, TransportConfig
from dcp_storage_testing.s3_server import MotoS3Server, S3Location

REPO = Path(__file__).resolve().parents[2]
_RUN = uuid.uuid4().hex[:8]
KEY = f"AKIASENTINEL5ECRET{_RUN.upper()}"
SECRET = f"SENTINEL-5ecret-secret-{_RUN}"
TOKEN = f"SENTINEL-5ecret-token-{_RUN}"
CONNECTION = f"DefaultEndpointsProtocol=https;AccountKey=SENTINEL-5ecret-conn-{_RUN}"
SENTINELS = (KEY, SECRET, TOKEN, CONNECTION, f"SENTINEL-5ecret-conn-{_RUN}")


def _leaks(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        return [s for s in SENTINELS if s.encode() in text]
    return [s for s in SENTINELS if s in text]


def _exception_text(exc: BaseException) -> str:
    """Everything an exception can show: str, repr, the formatted traceback with every chained cause, and
    for DCP's ``CheckpointException`` each rank's failure and its traceback."""
    parts, seen, todo = [], set(), [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        parts += [str(cur), repr(cur), "".join(traceback.format_exception(cur))]
        todo += [cur.__cause__, cur.__context__]
        if isinstance(cur, CheckpointException):
            for failure in cur.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                parts.append(str(failure))
                todo.append(inner)
    return "\n".join(parts)


@pytest.fixture
def secret_location(moto_server: MotoS3Server) -> Iterator[S3Location]:
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
    loc = moto_server.new_location(
        "ckpt", key=KEY, secret=SECRET, token=TOKEN, skip_instance_cache=True, use_listings_cache=False
    )
    yield loc
    S3FileSystem.clear_instance_cache()
    moto_server.delete_bucket(loc.url.split("/")[2])


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)  # every logger, botocore's signing and request logs included
    return caplog


def _all_log_text(caplog: pytest.LogCaptureFixture) -> str:
    parts = []
    for record in caplog.records:
        parts.append(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(_exception_text(record.exc_info[1]))
    return "\n".join(parts) + caplog.text


def _bucket_bytes(url: str, options: dict[str, Any]) -> dict[str, bytes]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url.split("/ckpt")[0], **options)
    return {path: fs.cat_file(path) for path in fs.find(root)}


def test_no_leak_through_the_python_api(secret_location: S3Location, debug_logs: pytest.LogCaptureFixture) -> None:
    url, opts = secret_location
    sd = {"w": torch.randn(8, 4), "b": torch.arange(5), "step": 3}
    writer = ds.FsspecWriter(url, opts)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    reader = ds.FsspecReader(url, opts)
    dest = {"w": torch.zeros(8, 4), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert torch.equal(dest["w"], sd["w"]) and dest["step"] == 3
    opened = ds.open_reader(url, storage_options=opts)
    dcp.load(dest, storage_reader=opened, no_dist=True)
    info = ds.describe(url, opts)
    report = ds.verify(url, opts)  # shallow: the CLI test runs --deep
    assert report.ok, report.problems

    st_url, pt_url = url + "-st", url + "-pt/model.pt"
    ds.convert(url, st_url, to="safetensors", storage_options=opts, drop_non_tensors=True)
    st_reader = ds.SafetensorsReader(st_url, opts)
    dcp.load({"w": torch.zeros(8, 4), "b": torch.zeros(5, dtype=torch.int64)}, storage_reader=st_reader, no_dist=True)
    ds.convert(url, pt_url, to="torch", storage_options=opts)
    pt_reader = ds.BroadcastingTorchSaveReader(pt_url, storage_options=opts)
    dcp.load(dest, storage_reader=pt_reader, no_dist=True)
    st_writer = ds.SafetensorsWriter(url + "-st2", opts)
    dcp.save({"w": sd["w"]}, storage_writer=st_writer, no_dist=True)

    shown = {
        "reprs": "\n".join(
            f"{o!r} {o!s}"
            for o in (
                writer,
                reader,
                opened,
                st_reader,
                pt_reader,
                st_writer,
                reader.transport,
                reader.transport.fs,
                reader.transport.config,
                opened.transport,
                st_reader.transport,
            )
        ),
        "describe": repr(info.as_dict()),
        "verify": repr(report.as_dict()),
        "logs": _all_log_text(debug_logs),
        "metadata": repr(pickle.loads(_bucket_bytes(url, opts)[url.removeprefix("s3://") + "/.metadata"])),
    }
    assert len(debug_logs.records) > 100, "DEBUG logging did not capture botocore's requests"
    assert any("x-amz-security-token" in r.getMessage().lower() for r in debug_logs.records), (
        "the session token header was never logged: this test would not see a leak"
    )
    leaks = {where: _leaks(text) for where, text in shown.items() if _leaks(text)}
    files = {path: _leaks(data) for path, data in _bucket_bytes(url, opts).items() if _leaks(data)}
    assert not leaks and not files, (leaks, files)


def test_no_leak_from_errors(
    secret_location: S3Location, moto_server: MotoS3Server, debug_logs: pytest.LogCaptureFixture
) -> None:
    url, opts = secret_location
    bucket = url.split("/")[2]
    dcp.save({"w": torch.ones(4)}, storage_writer=ds.FsspecWriter(url, opts), no_dist=True)
    attempts: dict[str, BaseException] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            attempts[name] = exc
        else:
            pytest.fail(f"{name}: no error")

    wrong = f"s3://no-such-bucket-{_RUN}/ckpt"
    attempt(
        "load wrong bucket",
        lambda: dcp.load({"w": torch.zeros(4)}, storage_reader=ds.FsspecReader(wrong, opts), no_dist=True),
    )
    attempt("open_reader wrong bucket", lambda: ds.open_reader(wrong, storage_options=opts))
    attempt("describe wrong bucket", lambda: ds.describe(wrong, opts))
    dead = {
        **opts,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    fast = TransportConfig(retry=RetryPolicy(max_attempts=1))
    attempt("unreachable endpoint", lambda: ds.FsspecReader(url, dead, transport_config=fast).read_metadata())
    from tests.storage.test_roundtrip_single_process import evil_reduce

    fs_url = url.removeprefix("s3://")
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    md = pickle.loads(fs.cat_file(fs_url + "/.metadata"))
    md.planner_data = evil_reduce(Path(f"/tmp/MARKER-{_RUN}"))
    fs.pipe_file(fs_url + "/.metadata", pickle.dumps(md))
    attempt(
        "unsafe checkpoint",
        lambda: dcp.load({"w": torch.zeros(4)}, storage_reader=ds.FsspecReader(url, opts), no_dist=True),
    )
    attempt("unsafe checkpoint describe", lambda: ds.describe(url, opts))
    assert not Path(f"/tmp/MARKER-{_RUN}").exists()
    report = ds.verify(url, opts, deep=True)
    assert not report.ok

    texts = {name: _exception_text(exc) for name, exc in attempts.items()}
    texts["verify"] = repr(report.as_dict())
    texts["logs"] = _all_log_text(debug_logs)
    leaks = {name: _leaks(text) for name, text in texts.items() if _leaks(text)}
    assert not leaks, {name: texts[name][:2000] for name in leaks}
    assert bucket in texts["unsafe checkpoint"] and "forbidden global" in texts["unsafe checkpoint"]


def test_no_leak_from_access_errors(
    secret_location: S3Location, moto_server: MotoS3Server, debug_logs: pytest.LogCaptureFixture
) -> None:
    """Credentials the store refuses: the StorageAccessError explains, and still shows no credential.

    moto checks every request as AWS would (:meth:`MotoS3Server.iam_auth`): the sentinel key id is unknown
    (``InvalidAccessKeyId``); a known key id with the sentinel secret and session token is refused
    (``InvalidToken``; to the HEAD requests of a save, a bare 400). Error messages, chained tracebacks, DEBUG logs (botocore logs response bodies) and the CLI's
    output must hold no sentinel, and must say where credentials come from.
    """
    url, opts = secret_location
    dcp.save({"w": torch.ones(4)}, storage_writer=ds.FsspecWriter(url, opts), no_dist=True)
    known_id, _ = moto_server.create_access_key(f"sentinel-{_RUN}")
    wrong_secret = {**opts, "key": known_id}  # the sentinel secret and token, with a key id moto knows
    from tests.cli._helpers import option_flags, run_batch

    flags = option_flags(
        {k: v for k, v in opts.items() if k not in ("skip_instance_cache", "use_listings_cache")}, "-o"
    )
    attempts: dict[str, BaseException] = {}
    with moto_server.iam_auth():
        for name, options in (("unknown key", opts), ("wrong secret", wrong_secret)):
            for what, fn in {
                "load": lambda o=options: dcp.load(
                    {"w": torch.zeros(4)}, storage_reader=ds.FsspecReader(url, o), no_dist=True
                ),
                "save": lambda o=options: dcp.save(
                    {"w": torch.ones(4)}, storage_writer=ds.FsspecWriter(url + "-new", o), no_dist=True
                ),
                "open_reader": lambda o=options: ds.open_reader(url, storage_options=o),
                "convert": lambda o=options: ds.convert(url, url + "-st", to="safetensors", storage_options=o),
            }.items():
                with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
                    fn()
                attempts[f"{name} {what}"] = info.value
        (cli,) = run_batch([["inspect", url, *flags]])
    texts = {name: _exception_text(exc) for name, exc in attempts.items()}
    texts["logs"] = _all_log_text(debug_logs)
    texts["cli"] = cli.stdout + cli.stderr
    leaks = {name: _leaks(text) for name, text in texts.items() if _leaks(text)}
    assert not leaks, {name: texts[name][-3000:] for name in leaks}
    for name, text in texts.items():
        if name != "logs":  # (dcp.load re-raises a metadata failure as its own AssertionError: message only)
            refused = "the store rejected the credentials" in text or "the store refused the request" in text
            assert refused and "-o key=... -o secret=..." in text, (name, text[-2000:])
    assert "InvalidAccessKeyId" in texts["unknown key load"] and "InvalidToken" in texts["wrong secret load"]
    assert cli.rc == 1, cli


def test_no_leak_through_the_cli(secret_location: S3Location) -> None:
    from tests.cli._helpers import option_flags, run_batch, run_cli

    url, opts = secret_location
    dcp.save({"w": torch.ones(4), "step": 1}, storage_writer=ds.FsspecWriter(url, opts), no_dist=True)
    flags = option_flags(
        {k: v for k, v in opts.items() if k not in ("skip_instance_cache", "use_listings_cache")}, "-o"
    )
    wrong = f"s3://no-such-bucket-{_RUN}/x"
    commands = {
        "inspect --json --debug": ["--debug", "inspect", url, "--json", *flags],
        "verify --deep --json --debug": ["verify", url, "--deep", "--json", "--debug", *flags],
        "verify wrong bucket": ["verify", wrong, "--json", *flags],
        "inspect wrong bucket": ["inspect", wrong, *flags],
        "convert": ["convert", url, url + "-out", "--to", "safetensors", "--drop-non-tensors", *flags],
        "malformed option": ["inspect", url, *flags, "-o", f"secret:{SECRET}"],
        "malformed dotted option": ["inspect", url, *flags, "-o", f"client_kwargs..token={TOKEN}"],
    }
    results = dict(zip(commands, run_batch(list(commands.values()), timeout=300)))
    # --debug on a failure re-raises out of main(): that needs a process of its own.
    debug = run_cli("--debug", "inspect", wrong, *flags)
    assert results["inspect --json --debug"].rc == 0, results["inspect --json --debug"]
    assert results["verify --deep --json --debug"].rc == 0, results["verify --deep --json --debug"]
    assert results["convert"].rc == 0, results["convert"]
    assert results["verify wrong bucket"].rc == 1 and results["inspect wrong bucket"].rc == 1
    assert results["malformed option"].rc == 2 and "KEY=VALUE" in results["malformed option"].stderr
    assert debug.rc == 1 and "Traceback" in debug.stderr
    outputs = {name: r.stdout + r.stderr for name, r in results.items()}
    outputs["inspect wrong bucket --debug"] = debug.stdout + debug.stderr
    leaks = {name: _leaks(text) for name, text in outputs.items() if _leaks(text)}
    assert not leaks, {name: outputs[name][-3000:] for name in leaks}


def test_redaction_helpers() -> None:
    from dcp_storage.text import CredentialLogFilter, redact, redacted_options, secret_values

    opts = {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": TOKEN},
        "connection_string": CONNECTION,
        "anon": False,
    }
    shown = redacted_options(opts)
    assert not _leaks(repr(shown)) and shown["client_kwargs"]["endpoint_url"] == "http://x" and shown["anon"] is False
    assert set(secret_values(opts)) == {KEY, SECRET, TOKEN, CONNECTION}
    assert not _leaks(redact(f"failed with {opts}", secret_values(opts)))
    record = logging.LogRecord(
        "botocore.endpoint",
        logging.DEBUG,
        __file__,
        1,
        "Sending http request: %s",
        (
            (
                f"headers={{'X-Amz-Security-Token': b'{TOKEN}', 'Authorization': b'AWS4-HMAC-SHA256 Credential={KEY}"
                "/2024/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=abc'}"
            ),
        ),
        None,
    )
    assert CredentialLogFilter().filter(record) and not _leaks(record.getMessage())
    assert "Sending http request" in record.getMessage()


# ----------------------------------------------------------------------------- secrets inside the URL
URL_SECRETS = (
    f"SENTINEL-pw-{_RUN}",
    f"SENTINEL-amzsig-{_RUN}",
    f"SENTINEL-googsig-{_RUN}",
    f"SENTINEL-sas-{_RUN}",
    f"SENTINEL-tok-{_RUN}",
)
_QUERY = (
    f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=3600&X-Amz-Signature={URL_SECRETS[1]}"
    f"&X-Goog-Signature={URL_SECRETS[2]}&sv=2022-11-02&sp=r&sig={URL_SECRETS[3]}&token={URL_SECRETS[4]}"
)


def _url_leaks(text: str) -> list[str]:
    return [s for s in URL_SECRETS if s in text]


def _shown_text(exc: BaseException) -> str:
    """What Python shows of an exception: str, repr and the traceback along the chain it prints (each
    ``__cause__``, or ``__context__`` unless suppressed), and for DCP's ``CheckpointException`` each rank's."""
    parts, seen, todo = [], set(), [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        parts += [str(cur), repr(cur), "".join(traceback.format_exception(cur))]
        todo.append(cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__))
        if isinstance(cur, CheckpointException):
            for failure in cur.failures.values():
                parts.append(str(failure))
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return "\n".join(parts)


@pytest.fixture
def presigned() -> Iterator[tuple[Any, str, str]]:
    """A loopback HTTP server with a safetensors file; its URL carries a password and presigned secrets."""
    from safetensors.torch import save as st_save

    from dcp_storage_testing.http_store import HttpStore

    with HttpStore({"model.safetensors": st_save({"w": torch.ones(4)})}) as server:
        host = server.base.split("://", 1)[1]
        url = f"http://reader:{URL_SECRETS[0]}@{host}/model.safetensors{_QUERY}"
        missing = f"http://reader:{URL_SECRETS[0]}@{host}/missing.safetensors{_QUERY}"
        yield server, url, missing


def test_no_url_secret_in_describe_verify_or_load_errors(
    presigned: tuple[Any, str, str], debug_logs: pytest.LogCaptureFixture
) -> None:
    server, url, missing = presigned
    opts = {"skip_instance_cache": True}
    info, report = ds.describe(url, opts), ds.verify(url, opts, deep=True)
    assert report.ok, report.problems
    assert info.url == url  # the field stays exact: it opens the checkpoint
    shown = {"describe": f"{info!r} {info.as_dict()!r}", "verify": f"{report!r} {report.as_dict()!r}"}
    failures = {
        "missing file": lambda: dcp.load(
            {"w": torch.zeros(4)}, storage_reader=ds.SafetensorsReader(missing, opts), no_dist=True
        ),
        "missing key": lambda: dcp.load(
            {"w": torch.zeros(4), "x": torch.zeros(1)}, storage_reader=ds.SafetensorsReader(url, opts), no_dist=True
        ),
        "describe missing": lambda: ds.describe(missing, opts),
        "verify missing": lambda: ds.verify(missing, opts),
    }
    for name, fn in failures.items():
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - any failure; its text is what counts
            shown[name] = _shown_text(exc)
        else:  # verify reports a missing checkpoint as a problem
            assert name == "verify missing" and not result.ok, (name, result)
            shown[name] = f"{result!r} {result.as_dict()!r} {result.problems!r}"
        if name != "missing key":
            assert "127.0.0.1" in shown[name], shown[name][-2000:]  # the message still names the file
    server.refuse["model.safetensors"] = 403
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(4)}, storage_reader=ds.SafetensorsReader(url, opts), no_dist=True)
    shown["403"] = _shown_text(caught.value)
    shown["logs"] = debug_logs.text + "\n".join(  # torch's DCP logger logs the checkpoint_id on a failure
        r.getMessage() + (_shown_text(r.exc_info[1]) if r.exc_info and r.exc_info[1] else "")
        for r in debug_logs.records
    )
    leaks = {name: _url_leaks(text) for name, text in shown.items() if _url_leaks(text)}
    assert not leaks, {name: shown[name][-3000:] for name in leaks}


def test_no_url_secret_in_cli_output(presigned: tuple[Any, str, str]) -> None:
    from tests.cli._helpers import run_batch

    _, url, missing = presigned
    commands = {
        "inspect": ["inspect", url],
        "inspect --json": ["inspect", url, "--json"],
        "verify --deep": ["verify", url, "--deep"],
        "verify --json": ["verify", url, "--json"],
        "inspect missing --debug": ["--debug", "inspect", missing],
        "verify missing": ["verify", missing],
    }
    results = dict(zip(commands, run_batch(list(commands.values()), timeout=300)))
    assert results["inspect"].rc == 0 and results["verify --deep"].rc == 0, results
    assert results["verify missing"].rc == 1
    outputs = {name: r.stdout + r.stderr for name, r in results.items()}
    assert "***" in outputs["inspect"] and "127.0.0.1" in outputs["inspect"]
    leaks = {name: _url_leaks(text) for name, text in outputs.items() if _url_leaks(text)}
    assert not leaks, {name: outputs[name][-3000:] for name in leaks}


def test_url_redaction_helper() -> None:
    from dcp_storage.text import mask_credentials, redact_urls

    for url in (
        f"https://b.s3.amazonaws.com/k{_QUERY}",
        f"https://acct.blob.core.windows.net/c/b.pt?sv=2022&se=2026&sr=b&sp=r&sig={URL_SECRETS[3]}",
        f"https://user:{URL_SECRETS[0]}@host:8443/x",
        f"gs://b/o?X-Goog-Credential=svc&X-Goog-Signature={URL_SECRETS[2]}",
    ):
        shown = redact_urls(f"{url}: no such file")
        assert not _url_leaks(shown) and shown.endswith(": no such file"), shown
        assert not _url_leaks(mask_credentials(url))
    assert redact_urls("https://h/x?X-Amz-Expires=3600&part=2") == "https://h/x?X-Amz-Expires=3600&part=2"


def test_pattern_masking_skips_only_texts_a_pattern_cannot_match() -> None:
    """The word gate in ``mask_credentials`` changes nothing: every pattern run on every text gives the same
    result, for ASCII texts in any case and for texts with letters that (?i) folds but ``lower`` does not."""
    import random

    from dcp_storage.text import _PATTERNS, mask_credentials, redact_urls

    def every_pattern(text: str) -> str:
        for pattern, replacement, _ in _PATTERNS:
            text = pattern.sub(replacement, text)
        return redact_urls(text)

    rng = random.Random(7)
    pieces = [
        "x-amz-security-token",
        "'x-amz-security-token'",
        "credential=",
        "x-amz-credential=",
        "'authorization'",
        ": b'",
        "=",
        " ",
        "/",
        "'",
        "&",
        "abc",
        "ſ",
        "K",
        "İ",
        "ı",
        "\u212a",
        ":",
    ]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8)))
        text = "".join(c.upper() if rng.random() < 0.3 else c for c in text)
        assert mask_credentials(text) == every_pattern(text), text
