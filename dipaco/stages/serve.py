"""`dipaco serve DIR`: an exported mixture behind an HTTP completions endpoint (OpenAI's /v1/completions
shape), each request routed by its prompt to one path (`dipaco.inference.server`).

    dipaco export out/demo --run runs/demo && dipaco serve out/demo --port 8000 --max-loaded 2
    curl -s localhost:8000/v1/completions -d '{"prompt": "In the beginning", "max_tokens": 20, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import logging

from dipaco.device import resolve_device
from dipaco.inference.mixture import Mixture
from dipaco.inference.server import CompletionServer

log = logging.getLogger(__name__)


def command(args: argparse.Namespace) -> None:
    mixture = Mixture(args.directory, route=args.route, max_loaded=args.max_loaded, device=resolve_device(args.device))
    server = CompletionServer(mixture, (args.host, args.port))
    host, port = server.server_address[:2]
    print(f"serving {args.directory} ({len(mixture.path_ids)} paths, {mixture.route} routing, at most "
          f"{args.max_loaded} in memory) on http://{host}:{port}/v1/completions; Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
