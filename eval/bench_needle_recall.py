"""Recall settings on the needle task: `kvgov eval synthetic` with extra cache names for `h2o@0.2+recall` variants
that the name syntax does not spell (more pages, neighbours, Quest's bounds), to see which page choice finds what the
full cache finds.

    OMP_NUM_THREADS=1 python eval/bench_needle_recall.py eval synthetic --model smollm2 --tasks needles \
        --lengths 8000 --samples 2 --seed 3 --filler ../shared/data/text/austen/mansfieldpark.txt \
        --max-new-tokens 8 --caches recall-pages64,recall-bounds --json out.json

Names: recall-pages16-spans (16 pages, one neighbour each side), recall-pages32, recall-pages64, recall-all (1,024
pages: every page of an 8k prompt), recall-bounds (8 pages ranked by Quest's bound), recall-bounds-spans.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from hf_kvgov import registry
from hf_kvgov.cli.main import main

BASE = "h2o@0.2+recall"
VARIANTS: dict[str, dict[str, Any]] = {
    "recall-pages16-spans": {"recall_pages": 16, "recall_neighbours": 1},
    "recall-pages32": {"recall_pages": 32},
    "recall-pages64": {"recall_pages": 64},
    "recall-all": {"recall_pages": 1024},
    "recall-bounds": {"recall_summary": "bounds"},
    "recall-bounds-spans": {"recall_summary": "bounds", "recall_neighbours": 1},
}


def register() -> None:
    """Add each variant to the registry's fixed names: the base chain with its disk tier's recall changed."""
    spec = registry.get_cache_spec(BASE)
    for name, changes in VARIANTS.items():

        def chain(model: Any, changes: dict[str, Any] = changes) -> Any:
            parts = spec.parts(model)
            return dataclasses.replace(parts, spill=dataclasses.replace(parts.spill, **changes))

        changed = ", ".join(f"{key}={value!r}" for key, value in changes.items())
        description = f"{spec.description} (this variant: Disk({changed}))"
        registry.CACHES[name] = dataclasses.replace(spec, name=name, chain=chain, description=description)


if __name__ == "__main__":
    register()
    sys.exit(main(sys.argv[1:]))
