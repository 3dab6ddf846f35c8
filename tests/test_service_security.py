"""The service's security over a real socket: HTTPS with --tls-cert/--tls-key, and the
bearer token never written to its log, its metrics or its error answers, whatever the
requests carry."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from live_fixtures import pool
from prometheus_fixture import free_port

TOKEN = "tok-7c1d9e0b5f2a4c6e8d3b1a9f"
SERVE = (sys.executable, "-m", "scaler", "serve")
NODE = {"name": "n-1", "gpus": 8, "gpu_model": "A100", "cpu_milli": 96_000, "memory_mib": 1 << 20}


def self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path, int]:
    config = {
        "state_dir": str(tmp_path / "state"),
        "pools": [pool()],
        "model": {"name": "persistence"},
        "placement": {"nodes": [NODE]},
    }
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "token").write_text(TOKEN + "\n")
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "GPUSCALE_SERVICE__TOKEN_FILE": str(tmp_path / "token")}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*SERVE, "--config", str(path), "--port", str(port), "--log-level", "debug", *args],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    return proc, log, port


def wait_ready(client: httpx.Client, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "gpuscale serve exited"
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("gpuscale serve did not come up")


@pytest.fixture
def stopping() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serves_https_with_the_given_certificate(
    tmp_path: Path, stopping: list[subprocess.Popen]
) -> None:
    cert, key = self_signed(tmp_path)
    proc, _, port = serve(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    stopping.append(proc)
    trusted = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trusted) as client:
        wait_ready(client, proc)
        reply = client.post(
            "/v1/placements",
            json={"id": "j", "cpu_milli": 1000, "memory_mib": 1024, "num_gpu": 1},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert reply.status_code == 201
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)


def test_a_certificate_without_its_key_is_refused(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    done = subprocess.run(
        [*SERVE, "--config", "unused.yaml", "--tls-cert", str(cert)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--tls-key" in done.stderr


def test_a_missing_or_unusable_certificate_is_one_line_before_serving(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    cases = [
        (["--tls-cert", str(tmp_path / "absent.crt"), "--tls-key", str(key)], "absent.crt"),
        (["--tls-cert", str(cert), "--tls-key", str(cert)], "not a PEM certificate matching"),
    ]
    for args, says in cases:
        done = subprocess.run(
            [*SERVE, "--config", "unused.yaml", *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_the_token_never_reaches_the_log_metrics_or_answers(
    tmp_path: Path, stopping: list[subprocess.Popen]
) -> None:
    proc, log, port = serve(tmp_path)
    stopping.append(proc)
    answers = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        wait_ready(client, proc)
        job = {"id": "j", "cpu_milli": 1000, "memory_mib": 1024, "num_gpu": 1}
        for auth in (TOKEN, TOKEN[:-1], TOKEN + "x", f"{TOKEN} {TOKEN}"):
            reply = client.post(
                "/v1/placements", json=job, headers={"Authorization": f"Bearer {auth}"}
            )
            answers.append(reply.text)
        bad = client.post(
            "/v1/placements",
            json={"id": "k", "num_gpu": "x"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        answers.append(bad.text)
        assert bad.status_code == 422
        answers.append(
            client.delete("/v1/placements/j", headers={"Authorization": f"Basic {TOKEN}"}).text
        )
        answers.append(client.get("/metrics").text)
    proc.terminate()
    proc.wait(timeout=10)
    assert answers[0].startswith("{") and '"node":"n-1"' in answers[0]
    for text in [*answers, log.read_text()]:
        assert TOKEN not in text and TOKEN[:-1] not in text
    assert "POST /v1/placements" in log.read_text()  # the log did record the requests
