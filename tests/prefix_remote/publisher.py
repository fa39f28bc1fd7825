"""Process A of the two-process test: build the tiny model from its seed, serve one request over the store
at argv[1] (namespace argv[2]), publish it, wait for the writer, print what happened as JSON."""

from __future__ import annotations

import json
import sys

from tests.prefix_remote.serving import DOCUMENT, model, question, remote_prefix, serve


def main(url: str, namespace: str) -> None:
    net = model()
    prefix = remote_prefix(net, url, namespace)
    served = serve(net, prefix, DOCUMENT + question(0))
    assert prefix.remote is not None and prefix.remote.flush(30)
    stats = prefix.stats().remote
    assert stats is not None
    print(json.dumps({"tokens": served.new_tokens, "reused": served.reused, "remote": stats.as_dict()}))
    prefix.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
