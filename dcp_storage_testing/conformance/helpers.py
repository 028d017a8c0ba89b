"""Helpers of the storage conformance suite: reference state dicts, bit-exact comparison, storage views.

Used by :class:`~dcp_storage_testing.conformance.StorageConformance` and by backend-specific suites beside
it. ``location`` arguments are ``(url, storage_options, backend)`` tuples (:class:`Location`).
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import fsspec
import torch

from dcp_storage.errors import unwrap  # noqa: F401 - re-exported: the suite has always offered it here
from dcp_storage.transports import TRANSPORT_OPTION, open_transport
from dcp_storage_testing.compare import raw_bytes as _raw


class Location(NamedTuple):
    """A fresh location on one backend: ``url, storage_options, backend = location``.

    ``backend`` names it (``"local"``, ``"file"``, ``"memory"``, ``"s3"``, ...; tests adapt a few checks to it).
    A suite's ``location`` fixture may also yield a plain ``(url, storage_options)`` pair: :func:`as_location`
    makes it a ``Location`` whose backend is the URL's scheme (``"local"`` for a path).
    """

    url: str
    storage_options: dict[str, Any]
    backend: str = ""


def as_location(location: Any) -> Location:
    """``location`` as a :class:`Location`: a ``Location``, a ``(url, storage_options[, backend])`` tuple."""
    if isinstance(location, Location) and location.backend:
        return location
    url, options, *rest = tuple(location)
    backend = rest[0] if rest and rest[0] else (url.split("://", 1)[0].lower() if "://" in url else "local")
    return Location(url, dict(options or {}), backend)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, denormals, -0.0) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def dcp_state_dict() -> dict[str, Any]:
    """Tensors of several dtypes and layouts, one above the reader's small-item size, and BYTE_IO values."""
    g = torch.Generator().manual_seed(7)
    return {
        "fp32": random_bits((33, 17), torch.float32, 1),
        "bf16": random_bits((40, 8), torch.bfloat16, 2),
        "fp16": random_bits((5, 7, 3), torch.float16, 3),
        "fp8": random_bits((16, 12), torch.float8_e4m3fn, 4),
        "int64": torch.randint(-(2**62), 2**62, (100,), generator=g, dtype=torch.int64),
        "bool": torch.rand(7, 9, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(24, 10, generator=g).t(),
        "big": random_bits((300, 400), torch.float32, 5),  # ranged read: header probe + data range
        "nested": {"w": torch.randn(6, 6, generator=g), "meta": {"epoch": 3}},
        "step": 7,  # BYTE_IO from here on
        "names": ["a", "b", 3, (4.5, None)],
        "note": "hello",
    }


def safetensors_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    sd: dict[str, torch.Tensor] = {"embed.weight": random_bits((64, 32), torch.float32, 20)}
    for layer in range(2):
        sd[f"layers.{layer}.attn.weight"] = torch.randn(32, 32, generator=g)
        sd[f"layers.{layer}.norm.weight"] = random_bits((32,), torch.bfloat16, 21 + layer)
        sd[f"layers.{layer}.mlp.weight"] = torch.randn(48, 32, generator=g).to(torch.float16)
    return sd


def destination_like(sd: Any) -> Any:
    """Same shapes and dtypes, filled with a sentinel byte, for ``dcp.load`` to overwrite."""
    if isinstance(sd, dict):
        return {k: destination_like(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        out = torch.empty(sd.shape, dtype=sd.dtype)
        torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage()).fill_(0xA5)
        return out
    return None  # BYTE_IO: replaced by the load


def assert_state_equal(actual: Any, expected: Any, key: str = "") -> None:
    """Bit-exact comparison of nested state dicts (tensors by raw bytes, dtype and shape)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{key}: keys differ"
        for k, v in expected.items():
            assert_state_equal(actual[k], v, f"{key}.{k}" if key else k)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{key}: got {type(actual).__name__}"
        assert (actual.dtype, tuple(actual.shape)) == (expected.dtype, tuple(expected.shape)), key
        assert torch.equal(_raw(actual), _raw(expected)), f"{key}: bytes differ"
    else:
        assert actual == expected, key


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    return sd.numel() * sd.element_size() if isinstance(sd, torch.Tensor) else 0


def child(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def fsspec_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for fsspec itself (and torch's fsspec reader/writer): without the ``transport`` choice."""
    return {k: v for k, v in options.items() if k != TRANSPORT_OPTION}


def shown_url(location: Any, name: str) -> str:
    """How errors must name ``name`` in the location: the local path, or the URL with the scheme the user wrote."""
    url, options, backend = as_location(location)
    if backend in ("local", "file"):
        return child(fsspec.core.url_to_fs(url, **fsspec_options(options))[1], name)
    return child(url, name)


def fsspec_knows(location: Any) -> bool:
    """Whether fsspec resolves the location's URL (a plugin transport's own scheme, ``kvflat://``, it does not)."""
    url, options, _ = as_location(location)
    try:
        fsspec.core.url_to_fs(url, **fsspec_options(options))
    except (ValueError, ImportError):
        return False
    return True


def stored(location: Any) -> dict[str, int]:
    """``{name: size}`` of every file directly under the location, seen through the backend's own fsspec
    filesystem, or, for a scheme fsspec does not know, through the transport the factory opens for it."""
    url, options, _backend = as_location(location)
    if not fsspec_knows(location):
        transport, root = open_transport(url, options)
        with transport:
            names = [n for n in transport.listdir(root) if not transport.listdir(transport.join(root, n))]
            return {n: transport.size(transport.join(root, n)) for n in names}
    fs, root = fsspec.core.url_to_fs(url, **fsspec_options(options))
    fs.invalidate_cache()
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries if e["type"] == "file"}


def counted_since(t: Any, before: dict[str, int]) -> dict[str, int]:
    """Counters of ``t`` moved since ``before`` (requests and bytes read)."""
    now = t.counters.snapshot()
    return {k: now[k] - before[k] for k in ("requests", "bytes_read")}


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)
