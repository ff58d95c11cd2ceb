"""Fail when committed generated code differs from what the protos generate.

Regenerates into a temporary directory with the same protoc invocation as
`make proto` and compares byte for byte, so a proto edit without `make proto`
(or a hand edit of generated code) cannot land.
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "proto"
GEN_DIR = ROOT / "src" / "bigfleet" / "v1alpha1"


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "bigfleet" / "v1alpha1").glob("*.proto"))
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    cwd_rc = protoc.main(args)
    if cwd_rc != 0:
        raise SystemExit(f"protoc failed with {cwd_rc}")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh = out / "bigfleet" / "v1alpha1"
        names = sorted(p.name for p in fresh.iterdir() if p.is_file())
        committed = sorted(p.name for p in GEN_DIR.iterdir() if p.is_file() and p.name != "__init__.py")
        stale = [n for n in names if not (GEN_DIR / n).exists() or not filecmp.cmp(fresh / n, GEN_DIR / n, shallow=False)]
        extra = [n for n in committed if n not in names and (n.endswith("_pb2.py") or n.endswith(".pyi") or n.endswith("_grpc.py"))]
        if stale or extra:
            print("generated code is stale; run `make proto` and commit:", file=sys.stderr)
            for n in stale:
                print(f"  differs: {n}", file=sys.stderr)
            for n in extra:
                print(f"  no longer generated: {n}", file=sys.stderr)
            return 1
    print(f"generated code up to date ({len(names)} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
