"""Prompt caching for mlx-lm models with MlxCacheController, end to end.

    python examples/mlx_controller.py --model /models/llama --root /var/cache/spool

Without ``--model`` a tiny random Llama is generated locally (no download). The script
plays two processes' worth of work on one store:

1. a controller prepares the cache of a long instruction + document prefix (cold
   prefill, written to the store) and answers a question from it;
2. a NEW controller (fresh model object, as after a restart) prepares the same prefix:
   read + verify from disk, no prefill; its answer is token-for-token the same;
3. the document grows: ``prepare`` reuses the stored prefix and prefills only the new
   part (incremental), and the old entry is released (``supersedes``);
4. ``release`` + ``close``: released entries are deleted when the controller closes.

Prints one JSON document; ``spoolctl status --root ROOT`` shows the store afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from spoolctl.controllers import CachePrepareParams, Element, MlxCacheController

DOC = " ".join(f"Clause {i}: the pump is primed before start-up, valve {i} stays shut."
               for i in range(40))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="local model directory (transformers or MLX format)")
    ap.add_argument("--root", help="store root (default: a temporary directory)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from spoolctl.demo.tinymodel import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "model", "tiny"))
        root = args.root or str(Path(tmp).resolve() / "store")
        # No model= needed: the params are for the controller's own model (any spelling of
        # its directory, or its model_id, would be the same key; another model is refused).
        params = CachePrepareParams(
            instructions=[Element("Answer from the manual only.", role="system")],
            data=[Element(DOC, role="user")],
        )
        question = "Which valve stays shut?"
        report: dict = {}

        with MlxCacheController(model, root) as ctl:  # "process" 1: cold
            handle = ctl.prepare(params)
            first = ctl.generate(handle, question, max_new_tokens=8)
            # usage of the first generate reports the cold prepare: computed and written
            report["cold"] = {"source": handle.source, "cached_tokens": handle.cached_tokens,
                              "written_tokens": handle.written_tokens, "tokens": first.tokens,
                              "usage": first.usage.to_json()}

        with MlxCacheController(model, root) as ctl:  # "process" 2: after a restart
            handle = ctl.prepare(params)
            again = ctl.generate(handle, question, max_new_tokens=8)
            report["restart"] = {"source": handle.source, "cached_tokens": handle.cached_tokens,
                                 "usage": again.usage.to_json(), "tokens": again.tokens,
                                 "same_tokens": again.tokens == first.tokens}

            grown = CachePrepareParams(
                instructions=params.instructions,
                data=[*params.data, Element("Appendix: valve 41 is new.", role="user")])
            bigger = ctl.prepare(grown)
            report["incremental"] = {"source": bigger.source,
                                     "reused_tokens": bigger.reused_tokens,
                                     "written_tokens": bigger.written_tokens,
                                     "supersedes": bigger.supersedes == handle.ref,
                                     "usage": ctl.generate(bigger, question,
                                                           max_new_tokens=8).usage.to_json()}
            ctl.release(bigger)
            report["entries_before_close"] = ctl.store.totals().entries
        with MlxCacheController(model, root) as ctl:
            report["entries_after_close"] = ctl.store.totals().entries
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
