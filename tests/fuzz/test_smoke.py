"""The short CI version of `make fuzz`: every target, a bounded number of inputs, fixed seed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bigfleet.tools import fuzz

from .known_open import is_known_open

EXECS = 1000


@pytest.mark.parametrize("name", sorted(fuzz.TARGETS))
def test_target_survives_mutation_fuzzing(name: str) -> None:
    harness, why = fuzz.load(name)
    if harness is None:
        pytest.skip(why)
    import random

    rng = random.Random(1234)
    corpus = fuzz.TARGETS[name].seeds()
    unexpected: list[str] = []
    for i in range(EXECS):
        data = corpus[i] if i < len(corpus) else fuzz.mutate(rng, rng.choice(corpus), corpus)
        exc = fuzz.run_one(harness, data)
        if exc is not None and not is_known_open(name, exc):
            unexpected.append(f"{type(exc).__name__}: {exc} <- {data!r}"[:400])
    assert not unexpected, unexpected[:3]


def test_seeds_are_accepted_not_just_rejected() -> None:
    """A harness that rejects its own seeds would fuzz nothing deep: the seeds must decode."""
    for name in ("rollup", "machine", "quantity", "session_frame"):
        harness, _ = fuzz.load(name)
        if harness is None:
            continue
        for seed in fuzz.TARGETS[name].seeds()[:1]:
            harness(seed)  # raises Rejected (a failure here) if the decoder refused it


def test_harness_flags_an_unexpected_exception() -> None:
    """The engine must report crashes, or every test above could pass vacuously."""
    original = fuzz.TARGETS["identity"]
    boom = fuzz.Target("boom", "always crashes", lambda: (lambda data: (_ for _ in ()).throw(KeyError(data))))
    fuzz.TARGETS["boom"] = boom
    try:
        stats = fuzz.fuzz_builtin("boom", seconds=0, max_execs=5)
        assert stats.crashes == 1 and "KeyError" in stats.note
        assert fuzz.fuzz_builtin("identity", seconds=0, max_execs=50).crashes == 0
    finally:
        del fuzz.TARGETS["boom"]
        assert fuzz.TARGETS["identity"] is original


def test_reader_is_total() -> None:
    r = fuzz.Reader(b"")
    assert r.integer() == 0 and r.text() == "" and r.choice([1, 2]) == 1 and r.size(10) == 0
    r = fuzz.Reader(bytes(range(256)) * 4)
    values = [fuzz.json_value(r, ["a", "b"]) for _ in range(20)]
    assert len(values) == 20


@pytest.mark.slow
def test_cli_runs_bounded_and_prints_a_table(tmp_path: object) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bigfleet.tools.fuzz", "--engine", "builtin", "--max-execs", "200",
         "--target", "quantity", "--target", "identity", "--crash-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "quantity" in res.stdout and "exec/s" in res.stdout
    listing = subprocess.run([sys.executable, "-m", "bigfleet.tools.fuzz", "--list"], capture_output=True, text=True, timeout=60)
    assert all(name in listing.stdout for name in fuzz.TARGETS)
