"""Feasibility probe for a mypyc-compiled decision core (docs/perf/engine.md, "mypyc-compiled core").

Not part of `make bench` and not used by the product: it copies ``src/`` to a scratch directory,
compiles part of it there with mypyc and benchmarks the engine pure vs compiled, interleaved.

    .venv/bin/python -m bench.mypyc_probe build A /tmp/core-A    # decision/* minus types.py
    .venv/bin/python -m bench.mypyc_probe build B /tmp/core-B    # + needs/*, machine/* (see EDITS_B)
    .venv/bin/python -m bench.mypyc_probe bench /tmp/core-B 3 uber5k realistic50k unmet phase2

``bench`` runs ``python -m bench.bench_engine SHAPE`` with ``PYTHONPATH=src`` and then with
``PYTHONPATH=<dir>``, REPS times per shape, and prints the lowest total per row for each.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: decision/types.py stays interpreted: its frozen dataclasses would become native classes, which
#: `decision.records` (``object.__new__`` + ``__dict__``) cannot build, and they are what crosses
#: the engine worker's pickle boundary.
SKIP_A = ("decision/types.py",)
#: Left interpreted in B: enums and exceptions (nothing to gain; compiling state.py makes mypyc
#: emit C that does not compile for ``st is MachineState.FAILED`` in validate.py), and the
#: Mapping/Collection subclasses (a non-native class with an ABC base fails at import with a
#: metaclass conflict).
SKIP_B = (*SKIP_A, "machine/state.py", "needs/errors.py", "needs/penalty.py", "machine/labels.py",
          "machine/inventory.py", "machine/__init__.py", "needs/__init__.py")
#: Record classes that rely on object.__new__/object.__setattr__/__reduce__: kept as ordinary
#: (non-native) classes, so layout, immutability and pickling are unchanged; only methods compile.
NON_NATIVE_B = {
    "needs/errors.py": ["ValidationError"],
    "needs/profile.py": ["Profile", "Need"],
    "needs/requirements.py": ["Requirement", "TopologySpread"],
    "needs/resources.py": ["Resources"],
    "machine/record.py": ["MachineShape", "Assignment", "Machine"],
}
#: Source edits B needs besides the decorators: class-body aliases of methods raise KeyError at
#: import in a compiled non-native class, and a compiled classmethod cannot be pickled by reference.
EDITS_B = {
    "needs/resources.py": [
        ("    sub_floor0 = saturating_sub\n",
         "    def sub_floor0(self, other: Resources) -> Resources:\n        return self.saturating_sub(other)\n"),
        ("        return (Resources._trusted, (self._items,))", "        return (_restore_resources, (self._items,))"),
        ("\nEMPTY = Resources()",
         "\ndef _restore_resources(items: tuple[tuple[str, int], ...]) -> Resources:\n"
         "    return Resources._trusted(items)\n\n\nEMPTY = Resources()"),
    ],
    "machine/record.py": [
        ("    reclamation_penalty_dollars = assigned_reclamation_penalty_dollars\n",
         "    @property\n    def reclamation_penalty_dollars(self) -> float:\n"
         "        return self.assignment.reclamation_penalty_dollars\n"),
    ],
}

SETUP = """\
from setuptools import setup
from mypyc.build import mypycify
setup(name="bigfleet-core-probe", ext_modules=mypycify({mods!r}, opt_level="3"), packages=[])
"""


def build(variant: str, out: Path) -> int:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ROOT / "src", out, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    pkg = out / "bigfleet"
    dirs = ["decision"] if variant == "A" else ["decision", "needs", "machine"]
    skip = SKIP_A if variant == "A" else SKIP_B
    if variant == "B":
        for rel, classes in NON_NATIVE_B.items():
            p = pkg / rel
            s = p.read_text()
            for c in classes:
                m = re.search(rf"^((?:@.*\n)*)class {c}\b", s, re.M)
                if m is None:
                    raise SystemExit(f"{rel}: class {c} not found")
                s = s[:m.start()] + "@mypyc_attr(native_class=False)\n" + s[m.start():]
            s = s.replace("from __future__ import annotations\n",
                          "from __future__ import annotations\n\nfrom mypy_extensions import mypyc_attr\n", 1)
            for old, new in EDITS_B.get(rel, []):
                if old not in s:
                    raise SystemExit(f"{rel}: expected source not found: {old.strip()!r}")
                s = s.replace(old, new)
            p.write_text(s)
    mods = sorted(f"bigfleet/{d}/{f.name}" for d in dirs for f in (pkg / d).glob("*.py")
                  if not f"bigfleet/{d}/{f.name}".endswith(skip))
    (out / "setup_probe.py").write_text(SETUP.format(mods=mods))
    return subprocess.call([sys.executable, "setup_probe.py", "build_ext", "--inplace", "-j", "2"], cwd=out)


def bench(compiled: Path, reps: int, shapes: list[str]) -> int:
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for _ in range(reps):
        for shape in shapes:
            for kind, path in (("pure", ROOT / "src"), ("compiled", compiled)):
                env = dict(os.environ, PYTHONPATH=f"{path}{os.pathsep}{ROOT}")
                out = subprocess.run([sys.executable, "-m", "bench.bench_engine", shape], env=env, cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout
                for line in out.splitlines():
                    m = re.match(r"^(\S+)\s+(.*?)\s{2,}((?:\s+[\d.]+){9})(\s+.*)?$", line)
                    if m:
                        key = (m.group(1), m.group(2)[:44])
                        rows.setdefault(key, {"pure": [], "compiled": []})[kind].append(float(m.group(3).split()[-1]))
    print(f"{'shape':<20} {'cycle':<46} {'pure ms':>9} {'compiled ms':>12} {'speedup':>8}  (lowest of {reps})")
    for (shape, cycle), v in rows.items():
        p, c = min(v["pure"]), min(v["compiled"])
        print(f"{shape:<20} {cycle:<46} {p:9.1f} {c:12.1f} {p / c:7.2f}x")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "build" and argv[1] in ("A", "B"):
        return build(argv[1], Path(argv[2]).resolve())
    if len(argv) >= 4 and argv[0] == "bench":
        return bench(Path(argv[1]).resolve(), int(argv[2]), argv[3:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
