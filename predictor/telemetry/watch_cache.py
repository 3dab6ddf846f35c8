"""The cluster as one watched cache per process: list once, page by page, then watch.

client-go's reflector, as Cluster Autoscaler's and Karpenter's shared informers use it:
each kind (`Reflector`) is listed once in pages (`limit`, then each page's `continue`
token), then watched from the list's resourceVersion; a watch that the server ends is
opened again from the last version seen, and one that answers 410 Gone (the version was
compacted away), or breaks, makes the kind list again, after a backoff that doubles up to
`max_backoff_s` while the API server keeps failing. The objects are read from the raw
JSON of the lists and the watch events (`_preload_content=False`, then `json.loads`):
the official client keeps the connection, the auth and the calls, but its model classes,
which cost about 0.8 ms a pod, are never built. Each object is turned once, when it
arrives, into what its reader (`read`) keeps of it, e.g. `kube_objects.read_pod`.

Every change is numbered (`serial`), so a consumer that keeps a snapshot of its own
updates it from `changes_since(serial)` instead of rebuilding it; a re-list counts as a
change only the objects whose resourceVersion differs from the cached one, and those gone.

A kind's status says whether its first list has landed (`listed`), since when its watch
has been down (`down_since`, None while it is open) and why (`error`): a consumer holds
what a stale view would get wrong (scale-downs) and says so.

One `ClusterCache` per process (`shared_cache`, by API server and object conventions)
holds the kinds every reader of the cluster needs, so the reconcile loop, the service and
the collector in one process read one cache and the API server serves one watch of each.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes.watch.watch import iter_resp_lines

from predictor.telemetry.kube_objects import KubeNames, NodeFacts, PodRequest, read_node, read_pod
from predictor.telemetry.paging import PAGE_SIZE

log = logging.getLogger(__name__)

T = TypeVar("T")
API_ERRORS = (k8s.ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)
UNFINISHED = "status.phase!=Succeeded,status.phase!=Failed"
SYSTEM_NAMESPACE = "kube-system"
JOURNAL_KEEP = 200_000  # changes kept for `changes_since`; a consumer further behind starts over


class Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


@dataclass
class CallCounts:
    """Requests a kind made, by verb (what the benchmark reports per pass)."""

    lists: int = 0  # list requests, a page each
    watches: int = 0  # watch requests opened
    events: int = 0  # watch events applied

    def as_dict(self) -> dict[str, int]:
        return {"list": self.lists, "watch": self.watches, "events": self.events}


@dataclass
class Reflector(Generic[T]):
    """One kind's cache: `call` is the official client's list method (namespace bound),
    `read` turns an object's JSON into what is kept of it."""

    kind: str
    call: Callable[..., Any]
    read: Callable[[Mapping[str, Any]], T]
    selector: Mapping[str, str] = field(default_factory=dict)  # fieldSelector etc.
    page_size: int = PAGE_SIZE
    watch_timeout_s: int = 300
    request_timeout_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    # A kind the cluster may not let gpuscale read (RBAC), or may not serve: a 403 or 404
    # reads as none of it, why kept in `refused`, asked again every `max_backoff_s`.
    optional: bool = False
    refused: str | None = None
    items: dict[str, T] = field(default_factory=dict)
    version: str | None = None  # the resourceVersion to watch from
    listed: bool = False
    down_since: float | None = None  # None: the watch is open (or about to be)
    error: str | None = "not listed yet"
    counts: CallCounts = field(default_factory=CallCounts)

    def __post_init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.serial = 0
        self._versions: dict[str, str] = {}
        self._journal: list[tuple[int, str]] = []  # (serial, key), serials ascending
        self._response: Any = None  # the open watch, so `stop` can close it

    # ---- reading ---------------------------------------------------------------------
    def snapshot(self) -> tuple[int, dict[str, T]]:
        with self.lock:
            return self.serial, dict(self.items)

    def objects(self) -> list[T]:
        """Every object kept, in no order (one copy, not a snapshot's dict)."""
        with self.lock:
            return list(self.items.values())

    def changes_since(self, serial: int) -> tuple[int, dict[str, T | None] | None]:
        """(the current serial, every key changed after `serial` with its object, None
        where it is gone); None for the changes when they are no longer all kept."""
        with self.lock:
            if serial == self.serial:
                return serial, {}
            if (self._journal and self._journal[0][0] > serial + 1) or serial > self.serial:
                return self.serial, None
            start = bisect_right(self._journal, (serial, "\uffff"))
            keys = {key for _, key in self._journal[start:]}
            return self.serial, {key: self.items.get(key) for key in keys}

    def wait_listed(self, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.listed, timeout=timeout_s)

    # ---- changing ----------------------------------------------------------------------
    def _note(self, key: str) -> None:
        self.serial += 1
        self._journal.append((self.serial, key))
        if len(self._journal) > JOURNAL_KEEP:
            del self._journal[: len(self._journal) // 2]

    def _put(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"
        self.items[key] = self.read(obj)
        self._versions[key] = str(meta.get("resourceVersion") or "")
        self._note(key)

    def _drop(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"
        if self.items.pop(key, None) is not None:
            self._versions.pop(key, None)
            self._note(key)

    def list(self) -> None:
        """List every page; the cache becomes the server's state (only what differs from
        the cached objects counts as changed). Raises Gone or an API error."""
        objects: list[dict[str, Any]] = []
        token: str | None = None
        version: str | None = None
        while True:
            kwargs: dict[str, Any] = dict(self.selector, limit=self.page_size)
            if token:
                kwargs["_continue"] = token
            page = self._json(self.call(**kwargs, _preload_content=False))
            self.counts.lists += 1
            meta = page.get("metadata") or {}
            version = version or meta.get("resourceVersion")
            objects.extend(page.get("items") or [])
            token = meta.get("continue") or None
            if not token:
                break
        read: dict[str, tuple[str, Mapping[str, Any]]] = {}
        for obj in objects:
            meta = obj.get("metadata") or {}
            key = f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"
            read[key] = (str(meta.get("resourceVersion") or ""), obj)
        with self.changed:
            for key in [k for k in self.items if k not in read]:
                del self.items[key]
                self._versions.pop(key, None)
                self._note(key)
            for key, (rv, obj) in read.items():
                if self._versions.get(key) != rv or key not in self.items:
                    self._put(obj)
            self.version = version
            self.listed = True
            self.refused = None
            self.down_since = None
            self.error = None
            self.changed.notify_all()

    def _json(self, response: Any) -> dict[str, Any]:
        try:
            return json.loads(response.data)
        finally:
            response.release_conn()

    def watch_once(self) -> None:
        """One watch from `version` until the server ends it. Raises Gone (410) or an
        API error."""
        response = self.call(
            **self.selector,
            watch=True,
            resource_version=self.version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _preload_content=False,
            _request_timeout=(
                self.request_timeout_s,
                self.watch_timeout_s + self.request_timeout_s,
            ),
        )
        self.counts.watches += 1
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if not line:
                    continue
                self._apply(json.loads(line))
        finally:
            self._response = None
            response.release_conn()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message") or "410 Gone")
            raise k8s.ApiException(status=obj.get("code"), reason=obj.get("message"))
        with self.changed:
            if kind == "DELETED":
                self._drop(obj)
            elif kind in ("ADDED", "MODIFIED"):
                self._put(obj)
            self.counts.events += 1
            self.version = (obj.get("metadata") or {}).get("resourceVersion") or self.version
            self.changed.notify_all()

    def run(
        self, stop: threading.Event, backoff_s: float = 1.0, max_backoff_s: float = 30.0
    ) -> None:
        """List, then watch until `stop`; relist after a 410 or a broken watch, with
        backoff while the API server fails."""
        delay = backoff_s
        while not stop.is_set():
            try:
                if not self.listed or self.version is None:
                    self.list()
                    log.info("%s: listed %d", self.kind, len(self.items))
                self.watch_once()
                delay = backoff_s
            except Gone as exc:
                log.info("watch of %s expired (%s); re-listing", self.kind, exc)
                self.version = None
            except k8s.ApiException as exc:
                if not (self.optional and exc.status in (403, 404)):
                    self._lost(exc, stop, delay)
                    delay = min(delay * 2, max_backoff_s)
                    continue
                self._refuse(exc)
                # Asked again after a while, or as soon as a reader's own list got it (a
                # grant taken up at a sample): the watch then goes on from that list.
                with self.changed:
                    self.changed.wait_for(
                        lambda: stop.is_set() or self.refused is None, timeout=max_backoff_s
                    )
            except API_ERRORS as exc:
                self._lost(exc, stop, delay)
                delay = min(delay * 2, max_backoff_s)

    def _lost(self, exc: Exception, stop: threading.Event, delay: float) -> None:
        if stop.is_set():
            return
        with self.lock:
            if self.down_since is None:
                self.down_since = self.clock()
                log.warning("watch of %s lost: %s", self.kind, exc)
            self.error = f"watch {self.kind}: {type(exc).__name__}: {exc}"
            self.version = None  # what was missed is only known from a list
        stop.wait(delay)

    def _refuse(self, exc: k8s.ApiException) -> None:
        """An optional kind the server will not show: none of it, and why."""
        with self.changed:
            for key in list(self.items):
                del self.items[key]
                self._versions.pop(key, None)
                self._note(key)
            if self.refused is None:
                log.warning("%s not read: HTTP %s %s", self.kind, exc.status, exc.reason)
                self._note("")  # a change of its own: readers learn it is refused
            self.refused = f"HTTP {exc.status}: {exc.reason}"
            self.version = None
            self.listed = True
            self.down_since = None
            self.error = None
            self.changed.notify_all()

    def stop(self) -> None:
        with self.changed:
            self.changed.notify_all()  # a refused kind waiting to ask again: it stops now
        response = self._response
        if response is not None:
            try:
                response.shutdown()
            except (AttributeError, OSError):  # urllib3 < 2.3 has no shutdown
                response.close()


@dataclass(frozen=True)
class CacheStatus:
    """Whether the cache can be read, and how old its view may be."""

    # The first list of every kind the snapshot is made of has landed (a kind joined
    # later, `watch_kind`, is waited for by its reader, so it holds up no other reader).
    listed: bool
    stale_s: float  # seconds the longest-down watch has been down (0: all open)
    errors: tuple[str, ...]
    refused: tuple[str, ...] = ()  # optional kinds the server will not show, why

    def to_dict(self) -> dict[str, Any]:
        return {
            "listed": self.listed,
            "stale_s": self.stale_s,
            "errors": list(self.errors),
            "refused": list(self.refused),
        }


def _budget(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """What a PodDisruptionBudget is read for: its selector (JSON form)."""
    return (obj.get("spec") or {}).get("selector") or {}


class ClusterCache:
    """Nodes, unfinished pods, kube-system's PodDisruptionBudgets and CronJobs, watched;
    and the kinds only some setups read, from the first ask on (`watch_kind`)."""

    def __init__(
        self,
        api: k8s.ApiClient,
        names: KubeNames,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.names = names
        self.clock = clock
        core = k8s.CoreV1Api(api)
        common: dict[str, Any] = {
            "watch_timeout_s": watch_timeout_s,
            "request_timeout_s": request_timeout_s,
            "clock": clock,
        }
        self._common = common
        self.nodes: Reflector[NodeFacts] = Reflector(
            "nodes", core.list_node, lambda o: read_node(o, names), **common
        )
        self.pods: Reflector[PodRequest] = Reflector(
            "pods",
            core.list_pod_for_all_namespaces,
            lambda o: read_pod(o, names),
            selector={"field_selector": UNFINISHED},
            **common,
        )
        policy = k8s.PolicyV1Api(api)
        self.budgets: Reflector[Mapping[str, Any]] = Reflector(
            "poddisruptionbudgets",
            lambda **kw: policy.list_namespaced_pod_disruption_budget(SYSTEM_NAMESPACE, **kw),
            _budget,
            optional=True,
            **common,
        )
        batch = k8s.BatchV1Api(api)
        self.cronjobs: Reflector[Mapping[str, Any]] = Reflector(
            "cronjobs", batch.list_cron_job_for_all_namespaces, dict, optional=True, **common
        )
        self._snapshot_kinds = (self.nodes, self.pods, self.budgets, self.cronjobs)
        self.kinds: list[Reflector[Any]] = list(self._snapshot_kinds)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Start watching (once): each kind lists and watches in a thread of its own."""
        with self._start_lock:
            if self._threads:
                return
            for kind in self.kinds:
                self._run(kind)

    def _run(self, kind: Reflector[Any]) -> None:
        thread = threading.Thread(
            target=kind.run, args=(self._stop,), name=f"watch-{kind.kind}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def watch_kind(
        self,
        kind: str,
        call: Callable[..., Any],
        selector: Mapping[str, str] | None = None,
    ) -> Reflector[dict[str, Any]]:
        """The kind named `kind`, which only some setups read (Kueue's, CapacityBuffers,
        Karpenter's): from the first reader that asks for it on, it is listed and watched
        as the others are (`call`, its list call; `selector`, its label selector etc.);
        every later ask gets the same one (its `call` unused). Its objects are kept as
        their JSON. A watch of it down counts in `status` (the snapshot's staleness); its
        first list is its readers' to wait for."""
        with self._start_lock:
            found = next((k for k in self.kinds if k.kind == kind), None)
            if found is None:
                found = Reflector(kind, call, dict, selector=dict(selector or {}), **self._common)
                # A new list, not an append: `status` may be reading the old one.
                self.kinds = [*self.kinds, found]
                if self._threads:
                    self._run(found)
            return found

    def wait_listed(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(k.wait_listed(max(0.0, deadline - time.monotonic())) for k in self.kinds)

    def status(self) -> CacheStatus:
        now = self.clock()
        kinds = self.kinds
        down = [now - k.down_since for k in kinds if k.down_since is not None]
        return CacheStatus(
            listed=all(k.listed for k in self._snapshot_kinds),
            stale_s=max(down, default=0.0),
            errors=tuple(k.error for k in kinds if k.error is not None),
            refused=tuple(f"{k.kind}: {k.refused}" for k in kinds if k.refused),
        )

    def counts(self) -> dict[str, dict[str, int]]:
        return {k.kind: k.counts.as_dict() for k in self.kinds}

    def close(self) -> None:
        self._stop.set()
        for kind in self.kinds:
            kind.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()


_SHARED: dict[tuple[str, KubeNames], ClusterCache] = {}
_HOLDS: dict[tuple[str, KubeNames], int] = {}  # how many readers hold each shared cache
_SHARED_LOCK = threading.Lock()


def cache_key(api: k8s.ApiClient, names: KubeNames) -> tuple[str, KubeNames]:
    """What makes two readers' caches one: the API server and the object conventions."""
    return str(api.configuration.host), names


def shared_cache(
    api: k8s.ApiClient,
    names: KubeNames,
    watch_timeout_s: int = 300,
    request_timeout_s: float = 10.0,
) -> ClusterCache:
    """The process's cache of the API server `api` talks to, read with `names`, started;
    the caller holds it until `release_shared` (the first caller's client and timeouts
    serve every reader)."""
    key = cache_key(api, names)
    with _SHARED_LOCK:
        cache = _SHARED.get(key)
        if cache is None:
            cache = _SHARED[key] = ClusterCache(api, names, watch_timeout_s, request_timeout_s)
        _HOLDS[key] = _HOLDS.get(key, 0) + 1
    cache.start()
    return cache


def release_shared(cache: ClusterCache) -> None:
    """Give back one hold of `cache` (a loop that ends, a collector that closes, a test);
    the last one closes it, and the next `shared_cache` makes a new one. Readers in one
    process come and go on their own: the collector closing leaves the loop its watches."""
    with _SHARED_LOCK:
        keys = [k for k, v in _SHARED.items() if v is cache]
        for key in keys:
            _HOLDS[key] -= 1
            if _HOLDS[key] > 0:
                return
            del _SHARED[key], _HOLDS[key]
    cache.close()
