"""Where the sandboxes keep their state: ``<repo>/.sandbox``, or ``$SKYPILOT_SANDBOX_DIR``.

A second set of sandboxes from one checkout (``make test`` runs its two shards at once, each on
its own) needs a state dir of its own, as it needs ports of its own
(``$SKYPILOT_SANDBOX_PORT_BASE``). Read at import: set both before starting Python.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def state_root() -> Path:
    return Path(os.environ.get("SKYPILOT_SANDBOX_DIR") or REPO_ROOT / ".sandbox").resolve()
