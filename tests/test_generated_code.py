"""The committed generated code is exactly what the protos generate (`make proto`)."""

from __future__ import annotations

from bigfleet.tools import protocheck


def test_committed_generated_code_is_not_stale(capsys: object) -> None:
    assert protocheck.main() == 0, "generated code is stale: run `make proto` and commit"


def test_staleness_is_detected(tmp_path: object, monkeypatch: object) -> None:
    """A hand edit of a generated file must be caught (the check can fail)."""
    from pathlib import Path

    real = protocheck.GEN_DIR
    fake = Path(str(tmp_path)) / "gen"
    fake.mkdir()
    for p in real.iterdir():
        if p.is_file():
            (fake / p.name).write_bytes(p.read_bytes())
    target = fake / "capacity_pb2.py"
    target.write_bytes(target.read_bytes() + b"\n# hand edit\n")
    monkeypatch.setattr(protocheck, "GEN_DIR", fake)  # type: ignore[attr-defined]
    assert protocheck.main() == 1
