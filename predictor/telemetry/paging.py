"""Lists read page by page, as client-go's pager reads them.

A list of every namespace's objects in one answer holds the API server's memory and the
connection as long as it takes to send; asked in pages (`limit`, then the `continue`
token of each page) the server sends a bounded answer at a time from one consistent
snapshot. `paged` wraps a client list method so that its callers (an informer's list,
a pass's listing) get every item as from one list, with the list's resourceVersion to
watch from; a watch through it is passed on unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

PAGE_SIZE = 500  # client-go's pager default


def _token(listing: Any) -> str | None:
    if isinstance(listing, dict):
        return (listing.get("metadata") or {}).get("continue") or None
    meta = getattr(listing, "metadata", None)
    return getattr(meta, "_continue", None) or None


def _items(listing: Any) -> list[Any]:
    found = listing.get("items") if isinstance(listing, dict) else listing.items
    return list(found or [])


def paged(call: Callable[..., Any], limit: int = PAGE_SIZE) -> Callable[..., Any]:
    """`call` (a list method of the official client, or a custom objects' list) reading
    every page: the first page's answer with the items of all of them and no continue
    token. A 410 Gone while paging (the snapshot was compacted away) propagates, so the
    caller lists again. With `watch=True` the call is made as it is (the docstring is
    kept: the client's Watch reads the type it returns from it)."""

    @functools.wraps(call)
    def listing(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("watch"):
            return call(*args, **kwargs)
        first = call(*args, limit=limit, **kwargs)
        items = _items(first)
        token = _token(first)
        while token:
            page = call(*args, limit=limit, _continue=token, **kwargs)
            items.extend(_items(page))
            token = _token(page)
        if isinstance(first, dict):
            first["items"] = items
            first.get("metadata", {}).pop("continue", None)
        else:
            first.items = items
            first.metadata._continue = None
        return first

    return listing
