"""A throw-away, in-memory Azure Blob endpoint for tests: azurite's blob service in a subprocess.

azurite is Microsoft's official storage emulator, an npm package. :func:`ensure_installed` runs
``npm install azurite@VERSION`` into a cache directory on first use (by default ``.servers/`` at the root
of a source checkout, git-ignored), so a fresh CI machine needs only ``node`` and ``npm`` on ``PATH``.
The install is serialised by a file lock and done in a temp directory that is renamed into place, so
parallel test processes never see half an install (:mod:`dcp_storage_testing._npm`).

The server runs with ``--inMemoryPersistence`` (nothing on disk) on 127.0.0.1, port 0: azurite reports
the port it got (``successfully listens on http://127.0.0.1:PORT``), which we parse, so there is no
probe-then-rebind race. Clients authenticate with azurite's well-known development account
(``devstoreaccount1``, a published key); :meth:`AzuriteServer.storage_options` gives adlfs a connection
string with the blob endpoint ``http://127.0.0.1:PORT/devstoreaccount1``, so the options alone reach the
server from any process.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import uuid
from typing import Any, NamedTuple

from dcp_storage.errors import DcpStorageError
from dcp_storage_testing._npm import npm_install, npm_script
from dcp_storage_testing._server_process import HOST as _HOST
from dcp_storage_testing._server_process import Launcher, ServerProcess

__all__ = [
    "ACCOUNT_KEY",
    "ACCOUNT_NAME",
    "AZURITE_VERSION",
    "AzureLocation",
    "AzuriteError",
    "AzuriteServer",
    "default_prefix",
    "ensure_installed",
]

AZURITE_VERSION = "3.37.0"
# azurite's built-in development account (public, documented by Microsoft; not a secret).
ACCOUNT_NAME = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_LISTENING = r"successfully listens on https?://[^\s:/]+:(\d+)"
_SERVERS_DIR_ENV = "DCP_STORAGE_SERVERS_DIR"
_FLAGS = ("--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck")
_ENTRY = ("dist", "src", "blob", "main.js")


class AzuriteError(DcpStorageError, RuntimeError):
    """azurite could not be installed or started (the message carries npm's or the server's output)."""


class AzureLocation(NamedTuple):
    """Where a test may write: an ``az://`` URL plus the fsspec (adlfs) options to reach it."""

    url: str
    storage_options: dict[str, Any]


def default_prefix(version: str = AZURITE_VERSION) -> str:
    """Where azurite is installed: ``$DCP_STORAGE_SERVERS_DIR``, else ``.servers/`` in a source checkout,
    else ``~/.cache/dcp-storage/servers``; one sub-directory per version."""
    base = os.environ.get(_SERVERS_DIR_ENV)
    if not base:
        checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if os.path.exists(os.path.join(checkout, "pyproject.toml")):
            base = os.path.join(checkout, ".servers")
        else:
            base = os.path.join(os.path.expanduser("~"), ".cache", "dcp-storage", "servers")
    return os.path.join(base, f"azurite-{version}")


def _script(prefix: str) -> str:
    return npm_script(prefix, "azurite", _ENTRY)


def ensure_installed(prefix: str | None = None, version: str = AZURITE_VERSION, timeout: float = 600.0) -> str:
    """Return the path of azurite's blob-service entry script, installing ``azurite@version`` if missing."""
    prefix = prefix or default_prefix(version)
    return npm_install(
        prefix, "azurite", version, _ENTRY, AzuriteError, timeout=timeout, ignore_scripts=True, owned=True
    )


class AzuriteServer(Launcher):
    """Run azurite's blob service on 127.0.0.1 with an OS-chosen port, in memory.

    Use as a context manager (or call :meth:`start` / :meth:`stop`)::

        with AzuriteServer() as server:
            url, options = server.new_location()      # a fresh container
            fs, path = fsspec.core.url_to_fs(url, **options)

    Args:
        prefix: the npm prefix holding ``node_modules/azurite`` (default :func:`default_prefix`).
        install: install azurite there if missing (else a missing install raises :class:`AzuriteError`).
    """

    def __init__(
        self,
        prefix: str | None = None,
        install: bool = True,
        startup_timeout: float = 60.0,
        log_lines: int = 200,
    ) -> None:
        super().__init__(startup_timeout, log_lines)
        self.prefix = prefix or default_prefix()
        self._install = install
        self._workdir: str | None = None
        self._client: Any = None

    # ------------------------------------------------------------------ lifecycle
    def _launch(self, deadline: float) -> ServerProcess:
        """Install azurite first if needed and allowed, then start it and wait until it answers HTTP."""
        if self._install:
            script = ensure_installed(self.prefix)
        else:
            script = _script(self.prefix)
            if not os.path.exists(script):
                raise AzuriteError(f"azurite is not installed under {self.prefix} (call ensure_installed)")
        node = shutil.which("node")
        if node is None:
            raise AzuriteError("azurite needs node on PATH")
        # azurite may write a debug log or extent files into its working directory: keep them out of the tree.
        self._workdir = tempfile.mkdtemp(prefix="azurite-")
        server = ServerProcess(
            "azurite",
            [node, script, "--blobHost", _HOST, "--blobPort", "0", *_FLAGS],
            AzuriteError,
            port_pattern=_LISTENING,
            cwd=self._workdir,
            log_lines=self._log_lines,
        )
        server.wait_ready(f"/{ACCOUNT_NAME}?comp=list", deadline)
        return server

    def _release(self) -> None:
        """Drop the cached client and remove the work dir."""
        self._client = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # ----------------------------------------------------------------- accessors
    @property
    def endpoint_url(self) -> str:
        """The blob endpoint, ``http://127.0.0.1:PORT/devstoreaccount1`` (azurite puts the account in the path)."""
        return f"http://{_HOST}:{self.port}/{ACCOUNT_NAME}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT_NAME};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.endpoint_url};"
        )

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """adlfs options for this server (development account, explicit endpoint); ``extra`` merged on top."""
        options: dict[str, Any] = {"connection_string": self.connection_string}
        options.update(extra)
        return options

    def sas_storage_options(self, via: str | None = None, **extra: Any) -> dict[str, Any]:
        """adlfs options that authenticate with an account SAS, through ``via`` (``http://host:port``) if given.

        A SAS signs the URL, not the headers (a shared key signs ``x-ms-range`` too), so a
        :class:`~dcp_storage_testing.fault_proxy.FaultProxy` at ``via`` may change a request's range.
        """
        from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas  # adlfs dependency

        sas = generate_account_sas(
            ACCOUNT_NAME,
            ACCOUNT_KEY,
            ResourceTypes(service=True, container=True, object=True),
            AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
            expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=12),
        )
        endpoint = f"{via}/{ACCOUNT_NAME}" if via else self.endpoint_url
        options: dict[str, Any] = {"connection_string": f"BlobEndpoint={endpoint};SharedAccessSignature={sas}"}
        options.update(extra)
        return options

    # ------------------------------------------------------------ container ops
    @staticmethod
    def unique_container_name(prefix: str = "test") -> str:
        """A fresh, valid container name (3-63 lowercase letters, digits, hyphens)."""
        return f"{prefix}-{uuid.uuid4().hex[:16]}".lower()

    def client(self) -> Any:
        """A synchronous ``azure.storage.blob.BlobServiceClient`` for this server (created lazily)."""
        if self._client is None:
            from azure.storage.blob import BlobServiceClient  # an adlfs dependency

            self._client = BlobServiceClient.from_connection_string(self.connection_string)
        return self._client

    def create_container(self, name: str) -> str:
        self.client().create_container(name)
        return name

    def delete_container(self, name: str) -> None:
        """Delete ``name`` and every blob in it (azurite keeps everything in memory)."""
        self.client().delete_container(name)

    def new_location(self, prefix: str = "ckpt", **extra: Any) -> AzureLocation:
        """Create a fresh container and return ``(az://container/prefix, storage_options)``."""
        container = self.create_container(self.unique_container_name())
        return AzureLocation(f"az://{container}/{prefix}", self.storage_options(**extra))
