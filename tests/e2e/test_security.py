"""Transport security: gRPC over TLS and mutual TLS, with certificates generated in the test."""

import subprocess
import sys

import pytest
from harness import start_mesh

from deltamesh.client import Client, Unavailable
from deltamesh.engine import DEFAULT_MODEL

pytestmark = pytest.mark.e2e


def make_pki(d):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=deltamesh-test-ca",
        "-keyout",
        f"{d}/ca.key",
        "-out",
        f"{d}/ca.pem",
    )
    for name in ("node", "client"):
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{d}/{name}.key",
            "-out",
            f"{d}/{name}.csr",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{d}/{name}.csr",
            "-CA",
            f"{d}/ca.pem",
            "-CAkey",
            f"{d}/ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{d}/{name}.ext",
            "-out",
            f"{d}/{name}.pem",
        )
    return {k: (d / f"{k}").read_bytes() for k in ("ca.pem", "client.key", "client.pem")}


def test_mutual_tls_mesh(tmp_path):
    pki = make_pki(tmp_path)
    tls = [
        "--tls-cert",
        str(tmp_path / "node.pem"),
        "--tls-key",
        str(tmp_path / "node.key"),
        "--tls-ca",
        str(tmp_path / "ca.pem"),
        "--tls-client-auth",
    ]
    mesh = start_mesh(
        str(DEFAULT_MODEL),
        tmp_path,
        worker_args=tls,
        router_args=tls,
        client_kwargs=dict(
            root_certificates=pki["ca.pem"], private_key=pki["client.key"], certificate_chain=pki["client.pem"]
        ),
    )
    try:
        with mesh.client() as client:
            assert client.generate("Secure", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        with Client(mesh.router_address, retries=0, root_certificates=pki["ca.pem"]) as no_cert:
            with pytest.raises(Unavailable):
                no_cert.generate("x", max_tokens=2)
        with Client(mesh.router_address, retries=0) as plaintext:
            with pytest.raises(Unavailable):
                plaintext.generate("x", max_tokens=2)
        health = subprocess.run(
            [sys.executable, "-m", "deltamesh.services.cli", "health", mesh.router_address, *tls], capture_output=True
        )
        assert health.returncode == 0, health.stderr
        assert mesh.wait_idle() == {}
    finally:
        mesh.stop()
