"""A real moto server process (``python -m moto.server``) on loopback, shared by the AWS provider tests."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("bigfleet_provider_aws")

from bigfleet.testing import ManagedProcess, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "providers" / "aws" / "examples"
MOTO_YAML = EXAMPLES / "moto.yaml"


class Moto:
    def __init__(self, url: str) -> None:
        self.url = url

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    port = free_port()
    proc = ManagedProcess([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], "moto",
                          log_dir=tmp_path_factory.mktemp("moto"))
    proc.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if not proc.alive():
            raise RuntimeError(f"moto server exited:\n{proc.logs()[-2000:]}")
        return urllib.request.urlopen(f"{url}/moto-api/", timeout=2).status == 200

    try:
        wait_until(up, 60, interval=0.2, what="moto server")
        yield Moto(url)
    finally:
        proc.stop()
