"""Bounds on a paged listing, so a store whose listing never ends cannot hold a load or a tool forever.

An S3 ``ListObjectsV2`` or ``ListMultipartUploads``, or a GCS object listing, goes on for as long as the
store hands out continuation tokens. A broken or hostile server that always answers "truncated, here is
the next token" would keep the caller listing, its memory growing with every page. So every paged listing
of the transports counts its pages and entries with a :class:`ListingBound` and stops with
:class:`~dcp_storage.errors.ListingTooLongError` naming the URL and the bound when it passes either, or at
once when the store hands back a token it gave before (a loop). The whole listing also runs under the
transport's :class:`~dcp_storage.transports.RetryPolicy` deadline (each page request is cancelled when it
passes, :mod:`.deadline`).

The bounds, read at each listing (so a process may change them before it lists):

* ``DCP_STORAGE_MAX_LIST_PAGES`` (default 1,000 pages): S3 and GCS answer up to 1,000 entries a page, so
  this is a million entries under one prefix, far more than a checkpoint directory or a run's steps hold;
* ``DCP_STORAGE_MAX_LIST_ENTRIES`` (default 1,000,000 entries kept): the memory bound when pages are large.
"""

from __future__ import annotations

from dcp_storage.errors import ListingTooLongError
from dcp_storage.settings import count_setting

__all__ = ["MAX_LIST_ENTRIES_ENV", "MAX_LIST_PAGES_ENV", "ListingBound"]

MAX_LIST_PAGES_ENV = "DCP_STORAGE_MAX_LIST_PAGES"
MAX_LIST_ENTRIES_ENV = "DCP_STORAGE_MAX_LIST_ENTRIES"
DEFAULT_MAX_PAGES = 1_000
DEFAULT_MAX_ENTRIES = 1_000_000


class ListingBound:
    """Counts one listing's pages and entries; :meth:`page` raises once a bound is passed."""

    def __init__(self, url: str, what: str = "objects") -> None:
        self.url = url
        self.what = what
        self.max_pages = max(1, count_setting(MAX_LIST_PAGES_ENV, DEFAULT_MAX_PAGES, "pages"))
        self.max_entries = max(1, count_setting(MAX_LIST_ENTRIES_ENV, DEFAULT_MAX_ENTRIES, "entries"))
        self.pages = 0
        self.entries = 0
        self._tokens: set[str] = set()

    def page(self, entries: int, next_token: str | None) -> None:
        """Count a page of ``entries`` that the store says continues at ``next_token`` (``None``: the last)."""
        self.pages += 1
        self.entries += entries
        if self.entries > self.max_entries:
            raise self._error(f"more than {self.max_entries} entries", MAX_LIST_ENTRIES_ENV)
        if next_token is None:
            return
        if next_token in self._tokens:
            raise ListingTooLongError(
                f"{self.url}: the listing of {self.what} handed back a continuation token it gave before, after "
                f"{self.pages} pages: it would never end (a broken or hostile store?)"
            )
        self._tokens.add(next_token)
        if self.pages >= self.max_pages:
            raise self._error(f"{self.pages} pages and still not done", MAX_LIST_PAGES_ENV)

    def _error(self, passed: str, env: str) -> ListingTooLongError:
        limit = self.max_pages if env == MAX_LIST_PAGES_ENV else self.max_entries
        return ListingTooLongError(
            f"{self.url}: the listing of {self.what} passed its bound ({passed}; {env}={limit}); a store whose "
            f"listing does not end (broken or hostile?), or raise {env} for a prefix that really holds more"
        )
