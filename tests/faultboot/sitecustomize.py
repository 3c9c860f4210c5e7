"""Loaded at start-up by every Python process the tests start (conftest puts this directory
on their ``PYTHONPATH``): installs ``tests/faultseam.py``'s hook when the process was asked
to crash, fail or pause at a store checkpoint. Nothing is imported otherwise."""

import os

if any(os.environ.get(v) for v in ("SPOOLCTL_CRASH_AT", "SPOOLCTL_FAIL_AT",
                                   "SPOOLCTL_PAUSE_AT")):
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "faultseam.py")
    _spec = importlib.util.spec_from_file_location("faultseam", _path)
    assert _spec is not None and _spec.loader is not None
    _seam = importlib.util.module_from_spec(_spec)
    sys.modules["faultseam"] = _seam
    _spec.loader.exec_module(_seam)
    try:
        _seam.install_from_env(os.environ)
    except ValueError as _exc:  # an unknown checkpoint: refuse to run at all
        sys.stderr.write(f"faultseam: {_exc}\n")
        os._exit(2)
