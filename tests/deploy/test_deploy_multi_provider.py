"""The bigfleet chart's shard.providers: one pool across several providers, rendered as one
``--provider=NAME=ADDRESS`` per entry on every shard replica, and refused when it cannot work."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import chartcheck as cc

_missing = cc.tools_missing()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

FAKE = "bigfleet-fake-provider.bigfleet-system.svc.cluster.local:7800"
AWS = "bigfleet-provider-aws.providers.svc.cluster.local:9400"


def _values() -> dict[str, Any]:
    return dict(cc.value_sets("bigfleet"))["multi-provider-values.yaml"]


def _argv(script: str, pod: str, tmp_path: Path) -> list[str]:
    fake = tmp_path / "bigfleet"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = subprocess.run(["/bin/sh", "-c", script], env={"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_NAME": pod},
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.splitlines()


def _render_error(values: dict[str, Any]) -> str:
    import helm_python as helm

    with pytest.raises(helm.HelmError) as info:
        cc.render("bigfleet", values)
    return str(info.value)


def test_every_shard_replica_draws_from_every_provider_with_per_provider_ownership(tmp_path: Path) -> None:
    from bigfleet.shard.cli import build_parser
    from bigfleet.shard.config import load_settings
    from bigfleet.shard.providers import ProviderSpec, parse_provider_specs

    shards = [c for c in cc.commands(cc.render("bigfleet", _values())) if c.subcommand == "shard"]
    assert len(shards) == 2
    for i, cmd in enumerate(shards):
        assert cmd.script is not None
        argv = _argv(cmd.script, f"bigfleet-shard-{i}-1", tmp_path)
        assert [a for a in argv if a.startswith("--provider")] == [f"--provider=metal={FAKE}", f"--provider=aws={AWS}"]
        # The chart's ownership rule holds per provider: shard-0 owns each provider's unmarked supply.
        assert f"--ownership={'exclusive' if i == 0 else 'shared'}" in argv
        # The daemon parses and validates exactly what the pod runs.
        ns = vars(build_parser().parse_args(argv[1:]))
        for k in [k for k in ns if k.startswith("tls_") or k == "config"]:
            ns.pop(k)
        settings = load_settings(None, ns)
        assert parse_provider_specs(settings.provider) == (ProviderSpec("metal", FAKE), ProviderSpec("aws", AWS))


def test_bad_provider_lists_are_refused_at_render() -> None:
    base = _values()
    shard = base["shard"]
    both = {**base, "shard": {**shard, "provider": {"address": "x:1"}}}
    assert "not both" in _render_error(both)
    twice = {**base, "shard": {**shard, "providers": [{"name": "a", "address": "x:1"}, {"name": "a", "address": "y:2"}]}}
    assert "given twice" in _render_error(twice)
    no_addr = {**base, "shard": {**shard, "providers": [{"name": "a"}]}}
    assert "address (host:port) is required" in _render_error(no_addr)
    no_fake = {**base, "fakeProvider": {"enabled": False}}
    assert "needs fakeProvider.enabled=true" in _render_error(no_fake)
    for bad in ({"name": "Metal", "address": "x:1"}, {"name": "a", "address": "no-port"}, {"name": "a", "adress": "x:1"}):
        assert "providers" in _render_error({**base, "shard": {**shard, "providers": [bad]}}), bad
