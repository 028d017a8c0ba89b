"""Read strategies: which rank fetches which stored bytes when several ranks need the same ones.

A reader (``FsspecReader``, ``SafetensorsReader``) turns a rank's load plan into storage reads; its read
strategy decides *who* reads. Strategies are objects built by the named factories of
:class:`ReadStrategies`, never flags:

* :meth:`ReadStrategies.per_rank` - every rank fetches every byte it needs itself (a DDP load of N ranks
  reads the checkpoint N times). Best where storage is local or cheaper than the network between ranks.
* :meth:`ReadStrategies.read_once` - bytes that several ranks need (DDP-replicated tensors, ``Replicate``
  placements of HSDP meshes, replicated norms of tensor-parallel layers) are fetched by exactly one of
  them, the reading balanced by bytes, and delivered to the others over the process group
  (:mod:`.read_once_plan`, :mod:`.read_once_exchange`). The default for object stores.
* :meth:`ReadStrategies.per_host` - the same, but ranks share reads only with ranks of their own host (a
  host key from the environment): storage is read once per host, and nothing crosses between hosts.

Choosing one: a reader's ``read_strategy=`` argument (a strategy or its name), else the ``"read_strategy"``
storage option (a name: ``"per_rank"``, ``"read_once"``, ``"per_host"``), else ``read_once`` for object
stores and ``per_rank`` for local files. Crossover (see the README, "Reading replicated state once"):
``read_once`` wins when the process group moves bytes faster than each rank can fetch them from storage,
the usual case for object stores (100s of MB/s per client) against NVLink, InfiniBand or even gloo on one
host; ``per_rank`` wins on a local disk or page cache.

What a strategy does at each step of a load (every rank unless noted):

1. ``local_plan(plan)`` in ``prepare_local_plan`` - may attach what the coordinator needs to know of this
   rank (its host key).
2. ``global_plan(plans, stored)`` in ``prepare_global_plan`` (DCP's coordinator) - may rewrite the plans
   (split big replicated items into row blocks) and attach each rank's part in ``plan.storage_data``.
3. ``read(plan, planner, read_items, stored)`` in ``read_data`` - fetches through ``read_items`` (the
   reader's own loader) what this rank must read, and exchanges what the plan says.

The built-in strategies tag each local plan with their name, and the coordinator refuses plans of ranks
that read with another strategy (:class:`~dcp_storage.errors.RankMismatchError`, naming every rank's):
ranks that disagree would wait in collectives the others never enter. ``read_once`` and ``per_host`` also
make every rank agree after the planner's ``finish_plan``, so a rank that fails there does not leave the
others waiting in the exchange (:mod:`.rank_agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dcp_storage import registry
from dcp_storage.errors import CorruptCheckpointError, RankMismatchError
from dcp_storage.formats.columns import columns_of, rows_of
from dcp_storage.registry import PluginNotFoundError
from dcp_storage.runtime import gc_paused
from dcp_storage.strategies.collectives import GroupView, load_view
from dcp_storage.strategies.rank_agreement import check_tags, guard_finish_plan, tag_plan
from dcp_storage.strategies.read_once_exchange import run_exchange
from dcp_storage.strategies.read_once_plan import ExchangePlan, RankInfo, ReadOnceConfig, plan_read_once
from dcp_storage.strategies.slice_delivery import DeliveryConfig
from dcp_storage.transports import READ_STRATEGY_OPTION  # the storage option naming a reader's strategy

__all__ = [
    "HOST_KEY_ENV",
    "MetadataItems",
    "READ_STRATEGY_OPTION",
    "ReadItems",
    "ReadOnceConfig",
    "ReadStrategies",
    "ReadStrategy",
    "StoredItems",
    "StrategyReading",
    "choose_read_strategy",
]


#: Environment variable naming this process's host for :meth:`ReadStrategies.per_host` (else torchrun's
#: ``GROUP_RANK``, else the host name).
HOST_KEY_ENV = "DCP_STORAGE_HOST_KEY"

ReadItems = Callable[[Sequence[ReadItem], LoadPlanner], None]


class StoredItems(Protocol):
    """What a strategy asks the reader about a planned item."""

    def dtype(self, item: ReadItem) -> torch.dtype:
        """The dtype the checkpoint stores the item's tensor in (what crosses the process group)."""
        ...

    def splittable(self, item: ReadItem) -> bool:
        """Whether row blocks of the item can be fetched alone (not compressed, not checked whole)."""
        ...


@runtime_checkable
class ReadStrategy(Protocol):
    """Who fetches what (see the module docstring for the call order)."""

    name: str

    def local_plan(self, plan: LoadPlan) -> LoadPlan: ...

    def global_plan(self, plans: list[LoadPlan], stored: StoredItems) -> list[LoadPlan]: ...

    def read(self, plan: LoadPlan, planner: LoadPlanner, read_items: ReadItems, stored: StoredItems) -> None: ...


class MetadataItems:
    """:class:`StoredItems` from a checkpoint's DCP ``Metadata``; ``splittable`` as the reader says."""

    def __init__(self, metadata: Metadata, splittable: Callable[[ReadItem], bool] = lambda item: True) -> None:
        self._metadata = metadata
        self._md = metadata.state_dict_metadata
        self._splittable = splittable
        self._dtypes: tuple[dict[str, int], list[Any], list[Any]] | None = None

    def dtype(self, item: ReadItem) -> torch.dtype:
        cols = columns_of(self._metadata)
        if cols is not None:  # from the columns: no entry built per item (a million items at scale)
            if self._dtypes is None:
                rows = rows_of(self._metadata) or {}
                self._dtypes = (rows, cols.prop.tolist(), [p.dtype for p in cols.properties])
            rows, prop, dtypes = self._dtypes
            r = rows.get(item.storage_index.fqn)
            if r is not None and prop[r] >= 0:
                return dtypes[prop[r]]
        md = self._md.get(item.storage_index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"no tensor {item.storage_index.fqn!r} in the checkpoint metadata")
        return md.properties.dtype

    def splittable(self, item: ReadItem) -> bool:
        return self._splittable(item)


class _PerRank:
    name = "per_rank"

    def __repr__(self) -> str:
        return "ReadStrategies.per_rank()"

    def local_plan(self, plan: LoadPlan) -> LoadPlan:
        return tag_plan(plan, self.name)

    def global_plan(self, plans: list[LoadPlan], stored: StoredItems) -> list[LoadPlan]:
        return check_tags(plans, self.name, untagged_ok=True)  # no collective: other readers may read alongside

    def read(self, plan: LoadPlan, planner: LoadPlanner, read_items: ReadItems, stored: StoredItems) -> None:
        read_items(plan.items, planner)


class _ReadOnce:
    """Shared stored slices read by one rank of those needing them (of one host, with ``host_key``)."""

    def __init__(self, name: str, config: ReadOnceConfig, host_key: Callable[[], str] | None) -> None:
        self.name = name
        self.config = config
        self.host_key = host_key

    def __repr__(self) -> str:
        return f"ReadStrategies.{self.name}(config={self.config!r})"

    def local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self.host_key is not None:
            plan = dataclasses.replace(plan, storage_data=RankInfo(host=str(self.host_key())))
        guard_finish_plan(_exchanges, self._check_final_plan)
        return tag_plan(plan, self.name)

    def global_plan(self, plans: list[LoadPlan], stored: StoredItems) -> list[LoadPlan]:
        view = load_view()
        plans = check_tags(plans, self.name, untagged_ok=not view.distributed or view.world == 1)
        hosts = [p.storage_data.host if isinstance(p.storage_data, RankInfo) else "" for p in plans]
        plans = [
            dataclasses.replace(p, storage_data=None) if isinstance(p.storage_data, RankInfo) else p for p in plans
        ]
        if not view.distributed or view.world == 1 or len(plans) != view.world:
            return plans  # alone, or torch's per-rank fallback planning one rank's plan at a time
        with gc_paused():  # millions of small acyclic objects at scale; collections would walk them all again
            return plan_read_once(plans, stored, self.config, hosts if self.host_key is not None else None)

    def read(self, plan: LoadPlan, planner: LoadPlanner, read_items: ReadItems, stored: StoredItems) -> None:
        exchange = plan.storage_data
        if not isinstance(exchange, ExchangePlan):
            read_items(plan.items, planner)
            return
        view = load_view()
        if not view.distributed:
            raise CorruptCheckpointError(
                f"{self.name}: the load plan exchanges slices between ranks, but this rank loads alone"
            )
        run_exchange(plan, exchange, planner, read_items, stored, view)

    def _check_final_plan(self, central: LoadPlan, final: LoadPlan, view: GroupView) -> None:
        """After ``finish_plan``: the exchange numbers this rank's items as the coordinator planned them."""
        exchange = final.storage_data
        if not isinstance(exchange, ExchangePlan) or len(final.items) != exchange.items:
            raise RankMismatchError(
                f"{self.name}: on rank {view.rank} the planner's finish_plan changed the plan the coordinator made "
                f"({len(central.items)} items, {len(final.items)} after finish_plan, storage_data "
                f"{type(exchange).__name__}); the ranks exchange slices by that plan, so finish_plan must keep its "
                "items and storage_data"
            )


def _exchanges(central_plan: LoadPlan) -> bool:
    """Whether this rank's read step runs the exchange (the coordinator planned one for every rank)."""
    return isinstance(central_plan.storage_data, ExchangePlan)


def _default_host_key() -> str:
    return os.environ.get(HOST_KEY_ENV) or os.environ.get("GROUP_RANK") or socket.gethostname()


class ReadStrategies:
    """Named factories of :class:`ReadStrategy` objects (see the module docstring)."""

    @staticmethod
    def per_rank() -> ReadStrategy:
        """Every rank reads every byte it needs from storage itself."""
        return _PerRank()

    @staticmethod
    def read_once(
        delivery_config: DeliveryConfig | None = None, *, split_bytes: int = 8 << 20, pack_below: int = 64 << 10
    ) -> ReadStrategy:
        """Each stored slice several ranks need is fetched once per job and sent to the others.

        ``delivery_config``: ``max_inflight_bytes`` bounds what one round of the exchange holds on a rank
        (slices read for others, and slices received into staging buffers). ``split_bytes``: replicated
        items larger than this are read as row blocks, spread over the ranks that need them.
        ``pack_below``: slices smaller than this travel packed, one message per pair of ranks and round.
        """
        return _ReadOnce(
            "read_once", ReadOnceConfig(delivery_config or DeliveryConfig(), split_bytes, pack_below), None
        )

    @staticmethod
    def per_host(
        host_key: str | Callable[[], str] | None = None,
        delivery_config: DeliveryConfig | None = None,
        *,
        split_bytes: int = 8 << 20,
        pack_below: int = 64 << 10,
    ) -> ReadStrategy:
        """As :meth:`read_once`, among the ranks of one host only: each host reads shared bytes once.

        ``host_key``: this process's host (a string, or a function giving it); default: the
        ``DCP_STORAGE_HOST_KEY`` environment variable, else torchrun's ``GROUP_RANK``, else the host name.
        """
        key: Callable[[], str]
        if host_key is None:
            key = _default_host_key
        elif isinstance(host_key, str):
            key = functools.partial(str, host_key)  # read on every rank when it plans
        elif callable(host_key):
            key = host_key
        else:
            raise TypeError(f"host_key must be a string or a callable, got {type(host_key).__name__}")
        config = ReadOnceConfig(delivery_config or DeliveryConfig(), split_bytes, pack_below)
        return _ReadOnce("per_host", config, key)

    @staticmethod
    def named(name: str) -> ReadStrategy:
        """The strategy called ``name`` with its defaults: ``"per_rank"``, ``"read_once"``, ``"per_host"``, or
        a plugin's, registered under the ``dcp_storage.strategies`` entry-point group (a ``ReadStrategy``, or
        a class or factory that makes one)."""
        factories: dict[str, Callable[[], ReadStrategy]] = {
            "per_rank": ReadStrategies.per_rank,
            "read_once": ReadStrategies.read_once,
            "per_host": ReadStrategies.per_host,
        }
        factory = factories.get(name) if isinstance(name, str) else None
        if factory is not None:
            return factory()
        try:
            return registry.instance(
                "strategies",
                name,
                lambda found: isinstance(found, ReadStrategy),
                "a read strategy must be a ReadStrategy",
            )
        except PluginNotFoundError:
            raise ValueError(
                f"unknown read strategy {name!r}; choose one of {', '.join(factories)}, or the name of a read "
                "strategy registered under the dcp_storage.strategies entry-point group"
            ) from None


def choose_read_strategy(given: ReadStrategy | str | None, option: Any, is_local: bool) -> ReadStrategy:
    """A reader's strategy: ``given`` (its argument), else ``option`` (the ``"read_strategy"`` storage option,
    which the reader takes out of the options it hands the filesystem), else by the kind of storage."""
    chosen = given if given is not None else option
    if chosen is None:
        return ReadStrategies.per_rank() if is_local else ReadStrategies.read_once()
    if isinstance(chosen, str):
        return ReadStrategies.named(chosen)
    if not isinstance(chosen, ReadStrategy):
        raise TypeError(f"read_strategy must be a ReadStrategy or its name, got {type(chosen).__name__}")
    return chosen


class StrategyReading:
    """The read-strategy wiring a reader composes (``FsspecReader``, ``SafetensorsReader``, ``RawTensorReader``).

    The reader builds it in its constructor, which takes the ``"read_strategy"`` storage option out of the
    options it hands the filesystem, and then forwards its steps:

    * ``_open`` (constructor, and ``reset`` to another checkpoint): :meth:`choose`, by the kind of storage;
    * ``reset``: :meth:`reset`; ``set_up_storage_reader``: :meth:`set_up` with what the strategy may ask
      about planned items (``None``: every rank reads its own plan, as in torch's rank-local fallback);
    * ``prepare_local_plan`` / ``prepare_global_plan``: :meth:`local_plan` / :meth:`global_plan`;
    * ``read_data``: :meth:`read` with the reader's own loader (``read_items``).
    """

    strategy: ReadStrategy  # set by choose(), which the reader's _open calls in its constructor

    def __init__(self, given: ReadStrategy | str | None, storage_options: dict[str, Any]) -> None:
        self._choice = (given, storage_options.pop(READ_STRATEGY_OPTION, None))
        self.stored: StoredItems | None = None

    def choose(self, is_local: bool) -> ReadStrategy:
        """The strategy: the reader's argument, else the storage option, else by the kind of storage."""
        self.strategy = choose_read_strategy(*self._choice, is_local=is_local)
        return self.strategy

    def reset(self) -> None:
        self.stored = None

    def set_up(self, stored: StoredItems | None) -> None:
        self.stored = stored

    def local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.strategy.local_plan(plan)

    def global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self.stored is None:
            return plans
        return self.strategy.global_plan(plans, self.stored)

    def read(self, plan: LoadPlan, planner: LoadPlanner, read_items: ReadItems) -> Future[None]:
        """``read_data``: the plan read through ``read_items``, by the strategy unless every rank reads its own."""
        if self.stored is None:
            read_items(plan.items, planner)
        else:
            self.strategy.read(plan, planner, read_items, self.stored)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
