"""The API server `gpuscale bench loop` measures against: loopback, in a process of its own.

A small server of the REST paths the loop reads (nodes, pods of all namespaces,
kube-system's PodDisruptionBudgets, CronJobs), with the semantics the cache relies on:
lists carry a resourceVersion and are paged with `limit` and `continue`, `?watch=true`
streams newline-separated JSON events from a resourceVersion (410 Gone once compacted).
Objects are kept as their JSON bytes in name order, so a page is a slice and a list of
150,000 pods costs the server little next to the client it measures. It counts every
request by kind and verb. The product's tests use the fuller fake of tests/fake_kube.py;
this one ships with the benchmark, which the product may not build from tests/.

It runs in a child process (`ApiProcess`): the benchmark's peak RSS is then gpuscale's
own, not the server's copy of the cluster. The child generates the cluster itself
(`loop_cluster.generate_cluster`) and applies each pass's churn (`ClusterChurn`) when told.
"""

from __future__ import annotations

import base64
import json
import subprocess  # nosec B404
import sys
import threading
from bisect import bisect_right, insort
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from scaler.evaluation.loop_cluster import ClusterChurn, generate_cluster

Obj = dict[str, Any]
PATHS = {  # path -> kind
    "/api/v1/nodes": "nodes",
    "/api/v1/pods": "pods",
    "/apis/policy/v1/namespaces/kube-system/poddisruptionbudgets": "poddisruptionbudgets",
    "/apis/batch/v1/cronjobs": "cronjobs",
}
LIST_KINDS = {
    "nodes": ("NodeList", "v1"),
    "pods": ("PodList", "v1"),
    "poddisruptionbudgets": ("PodDisruptionBudgetList", "policy/v1"),
    "cronjobs": ("CronJobList", "batch/v1"),
}


@dataclass
class _Kind:
    keys: list[tuple[str, str]] = field(default_factory=list)  # (namespace, name), sorted
    objects: dict[tuple[str, str], bytes] = field(default_factory=dict)


class LoopApi:
    """The state and the HTTP server around it (`start` binds 127.0.0.1)."""

    def __init__(self) -> None:
        self.kinds = {kind: _Kind() for kind in LIST_KINDS}
        self.rv = 0
        self.events: list[tuple[int, str, bytes]] = []  # (rv, kind, event line)
        self.compacted = 0
        self.changed = threading.Condition()
        self.requests: Counter[tuple[str, str]] = Counter()  # (kind, verb)
        self.closing = False
        self.server: ThreadingHTTPServer | None = None

    # ---- state ------------------------------------------------------------------------
    def put(self, kind: str, obj: Obj, event: bool = True) -> None:
        with self.changed:
            self.rv += 1
            meta = obj["metadata"]
            meta["resourceVersion"] = str(self.rv)
            key = (meta.get("namespace") or "", meta["name"])
            store = self.kinds[kind]
            added = key not in store.objects
            if added:
                insort(store.keys, key)
            store.objects[key] = json.dumps(obj, separators=(",", ":")).encode()
            if event:
                self._event(kind, "ADDED" if added else "MODIFIED", store.objects[key])

    def delete(self, kind: str, key: tuple[str, str]) -> None:
        with self.changed:
            store = self.kinds[kind]
            body = store.objects.pop(key, None)
            if body is None:
                return
            store.keys.pop(bisect_right(store.keys, key) - 1)
            self.rv += 1
            obj = json.loads(body)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self._event(kind, "DELETED", json.dumps(obj, separators=(",", ":")).encode())

    def get(self, kind: str, key: tuple[str, str]) -> Obj | None:
        body = self.kinds[kind].objects.get(key)
        return None if body is None else json.loads(body)

    def _event(self, kind: str, type_: str, body: bytes) -> None:
        line = b'{"type":"' + type_.encode() + b'","object":' + body + b"}\n"
        self.events.append((self.rv, kind, line))
        self.changed.notify_all()

    def page(self, kind: str, query: dict[str, str]) -> bytes:
        store = self.kinds[kind]
        with self.changed:
            rv = str(self.rv)
            start = 0
            token = query.get("continue")
            if token:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                rv = str(state["rv"])
                start = bisect_right(store.keys, tuple(state["after"]))
            limit = int(query.get("limit") or 0) or len(store.keys)
            keys = store.keys[start : start + limit]
            items = [store.objects[k] for k in keys]
            meta: Obj = {"resourceVersion": rv}
            if start + limit < len(store.keys):
                after = {"rv": rv, "after": list(keys[-1])}
                meta["continue"] = base64.urlsafe_b64encode(json.dumps(after).encode()).decode()
        list_kind, version = LIST_KINDS[kind]
        head = json.dumps({"kind": list_kind, "apiVersion": version, "metadata": meta})
        return head[:-1].encode() + b',"items":[' + b",".join(items) + b"]}"

    def events_after(self, kind: str, since: int, timeout: float) -> list[bytes] | None:
        """Event lines of `kind` after `since` (waiting up to `timeout` for one); None when
        `since` was compacted away or the server is closing."""
        with self.changed:
            if since < self.compacted or self.closing:
                return None

            def found() -> list[bytes]:
                at = bisect_right(self.events, (since, "\uffff", b""))
                return [line for rv, k, line in self.events[at:] if k == kind]

            lines = found()
            if not lines:
                self.changed.wait(timeout)
                lines = found()
            return None if self.closing else lines

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> str:
        handler = type("Handler", (_Handler,), {"api": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    api: LoopApi

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        kind = PATHS.get(url.path)
        watching = query.get("watch") in ("1", "true", "True")
        self.api.requests[(kind or url.path, "watch" if watching else "list")] += 1
        if kind is None:
            body = b'{"kind":"Status","code":404,"message":"not served"}'
            self._send(404, body)
        elif watching:
            self._watch(kind, query)
        else:
            self._send(200, self.api.page(kind, query))

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _watch(self, kind: str, query: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        since = int(query.get("resourceVersion") or self.api.rv)
        timer = threading.Event()
        threading.Timer(float(query.get("timeoutSeconds") or 60), timer.set).start()
        try:
            while not timer.is_set():
                lines = self.api.events_after(kind, since, 0.2)
                if lines is None:
                    if since < self.api.compacted:
                        gone = b'{"type":"ERROR","object":{"kind":"Status","code":410}}\n'
                        self.wfile.write(f"{len(gone):x}\r\n".encode() + gone + b"\r\n")
                    break
                for line in lines:
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    since = int(json.loads(line)["object"]["metadata"]["resourceVersion"])
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.close_connection = True


def _serve(nodes: int, pods: int, seed: int) -> None:
    """The child (`python -m scaler.evaluation.loop_api N M SEED`): the cloud names as one
    JSON line on stdin, then one command a line ("churn", "counts", "stop"), each answered
    with one JSON line on stdout."""
    cloud_names = json.loads(sys.stdin.readline())
    cluster = generate_cluster(nodes, pods, seed, cloud_names)
    api = LoopApi()
    for node in cluster.nodes:
        api.put("nodes", node, event=False)
    for pod in cluster.pods:
        api.put("pods", pod, event=False)
    churn = ClusterChurn(cluster, seed=seed)

    def answer(value: Any) -> None:
        sys.stdout.write(json.dumps(value) + "\n")
        sys.stdout.flush()

    answer({"url": api.start(), "gpu_pods": cluster.gpu_pods})
    for line in sys.stdin:
        command = line.strip()
        if command == "stop":
            break
        if command == "counts":
            answer({f"{k}:{v}": n for (k, v), n in api.requests.items()})
        elif command == "churn":
            created, gone, changed, added = churn.step()
            for node in added:
                api.put("nodes", node)
            for pod in created:
                api.put("pods", pod)
            for key in gone:
                api.delete("pods", key)
            for change in changed:
                obj = api.get("pods", tuple(change["key"]))
                if obj is not None:
                    obj["metadata"]["labels"]["revision"] = change["label"]
                    api.put("pods", obj)
            answer(
                {
                    "rv": api.rv,
                    "created": len(created),
                    "deleted": len(gone),
                    "changed": len(changed),
                    "nodes_added": len(added),
                }
            )
    api.stop()
    answer("stopped")


class ApiProcess:
    """The fake API server in a child process: `url`, `churn()` and `counts()`."""

    def __init__(
        self, nodes: int, pods: int, seed: int = 0, cloud_names: dict[str, list[str]] | None = None
    ) -> None:
        # The bench's own fake API server: this interpreter, this module, three ints.
        self._process = subprocess.Popen(  # nosec B603
            [sys.executable, "-m", __name__, str(nodes), str(pods), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._ask(json.dumps(cloud_names or {}))
        self.url: str = hello["url"]
        self.gpu_pods: int = hello["gpu_pods"]

    def _ask(self, line: str) -> Any:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fake API server ended (exit {self._process.poll()})")
        return json.loads(answer)

    def churn(self) -> dict[str, int]:
        return self._ask("churn")

    def counts(self) -> Counter[str]:
        return Counter(self._ask("counts"))

    def stop(self) -> None:
        try:
            self._ask("stop")
        except (OSError, RuntimeError):
            pass
        finally:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
