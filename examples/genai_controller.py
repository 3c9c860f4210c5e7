"""Context caching on the Gemini API with GoogleGenAICacheController.

Against a local fake (no network, no key needed)::

    python examples/genai_controller.py --fake

Against any server speaking the Gemini REST API (e.g. the fake started elsewhere)::

    GENAI_BASE_URL=http://127.0.0.1:8765 GOOGLE_API_KEY=test-key \\
        python examples/genai_controller.py --root /tmp/spool-example

Without GENAI_BASE_URL it talks to Google with GOOGLE_API_KEY (cached contents are
billed per hour; the controller deletes what it created when it closes). Afterwards
``spoolctl status --root ...`` lists any genai records left, and
``spoolctl clean --genai`` retries server deletes that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from google import genai
from google.genai import types

from spoolctl.controllers import CachePrepareParams, Element, GoogleGenAICacheController
from spoolctl.controllers.genai.records import format_expiry, genai_status

MANUAL = " ".join(f"Section {i}: the pump must be primed before start-up, step {i}."
                  for i in range(200))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", help="store root (default: a temporary directory)")
    ap.add_argument("--model", default="gemini-2.0-flash")
    ap.add_argument("--ttl", default="600s")
    ap.add_argument("--fake", action="store_true",
                    help="start the local fake server from tests/genai_fake.py")
    args = ap.parse_args()

    with contextlib.ExitStack() as stack:
        base_url = os.environ.get("GENAI_BASE_URL")
        api_key = os.environ.get("GOOGLE_API_KEY") or os.environ.get("GEMINI_API_KEY")
        if args.fake:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from genai_fake import FakeGenAIServer

            base_url = stack.enter_context(FakeGenAIServer(api_key="example-key")).base_url
            api_key = "example-key"
        if not api_key:
            print("set GOOGLE_API_KEY (or pass --fake)", file=sys.stderr)
            return 2
        options = types.HttpOptions(base_url=base_url, api_version="v1beta") if base_url else None
        client = genai.Client(api_key=api_key, http_options=options)
        root = args.root or os.path.join(
            os.path.realpath(stack.enter_context(tempfile.TemporaryDirectory())), "store")

        params = CachePrepareParams(
            model=args.model,
            instructions=[Element("Answer from the maintenance manual only.")],
            data=[Element(MANUAL, role="user")],
        )
        with GoogleGenAICacheController(client, root, ttl=args.ttl,
                                        display_name="example-manual") as ctl:
            handle = ctl.prepare(params)
            print(f"cache {handle.ref} ({handle.source}, {handle.cached_tokens} tokens)")
            for question in ("What comes before start-up?", "Which step is 42?"):
                result = ctl.generate(handle, question, max_new_tokens=64)
                print(f"Q: {question}\nA: {result.text.strip()}\n   usage: "
                      f"{json.dumps(result.usage.to_json())}")
            for row in genai_status(ctl.store):
                print(f"store: {row.name} {row.state} expires {format_expiry(row.expires_in)}")
            print("stats:", json.dumps(ctl.stats()))
        print("closed: the cache was deleted on the server")
    return 0


if __name__ == "__main__":
    sys.exit(main())
