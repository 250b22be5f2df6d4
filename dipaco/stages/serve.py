"""`dipaco serve DIR`: an exported mixture behind OpenAI's completions API (`dipaco.inference.server`, on
FastAPI and uvicorn: `pip install 'dipaco[serve]'`), each request routed by its prompt to one path.

    dipaco export out/demo --run runs/demo && dipaco serve out/demo --port 8000
    curl -s localhost:8000/v1/completions -d '{"prompt": "In the beginning", "max_tokens": 20, "temperature": 0}'

Every path is loaded before the first request when all fit in memory (`path_memory.keep_loaded`), else as
many as fit, with a warning; `--max-loaded N` sets the number instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

log = logging.getLogger(__name__)

NEEDED = ("fastapi", "uvicorn")


def missing_packages() -> list[str]:
    """The server's packages that are not installed."""
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def command(args: argparse.Namespace) -> None:
    missing = missing_packages()
    if missing:
        raise RuntimeError(f"dipaco serve needs {' and '.join(missing)}, which are not installed: "
                         f"pip install 'dipaco[serve]' (or: pip install {' '.join(NEEDED)})")
    from dipaco.device import resolve_device
    from dipaco.inference.mixture import Mixture
    from dipaco.inference.path_memory import keep_loaded
    from dipaco.inference.server import build_app, serve

    mixture = Mixture(args.directory, route=args.route, max_loaded=args.max_loaded, device=resolve_device(args.device))
    if args.max_loaded is None:
        kept = keep_loaded(mixture)
    else:
        kept = args.max_loaded
        if kept < len(mixture.path_ids) and mixture.route == "likelihood":
            log.warning("--max-loaded %d of %d paths with likelihood routing: every request reloads paths from disk",
                        kept, len(mixture.path_ids))
    app = build_app(mixture)
    in_memory = "all" if kept is None or kept >= len(mixture.path_ids) else f"at most {kept}"
    print(f"serving {args.directory} as model {app.state.engine.name!r} ({len(mixture.path_ids)} paths, "
          f"{mixture.route} routing, {in_memory} in memory) on http://{args.host}:{args.port}/v1/completions; "
          "Ctrl-C stops", flush=True)
    serve(app, host=args.host, port=args.port, log_level="debug" if args.verbose else "info")
