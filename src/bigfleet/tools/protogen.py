"""`make proto`: regenerate src/bigfleet/v1alpha1 from proto/ (same invocation protocheck verifies)."""

from __future__ import annotations

from bigfleet.tools.protocheck import ROOT, generate


def main() -> int:
    generate(ROOT / "src")
    print("regenerated src/bigfleet/v1alpha1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
