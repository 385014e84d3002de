"""``demo``, ``serve``, ``route`` and ``bench``: the commands whose arguments
belong to another program. The rest of the command line goes, untouched, to
that program's own ``main``, imported only then, so that ``blockkv stats``
never imports mlx-lm's server or the router.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from blockkv.cli.common import EXIT_USAGE, UsageError

# the passthrough commands, with their line in 'blockkv --help'
PASSTHROUGH = {
    "demo": "run the blockkv demo (arguments go to blockkv.mlx_lm.demo)",
    "serve": "run mlx-lm's server with blockkv as its cold tier (arguments go to blockkv.node.serve)",
    "route": "route requests to a fleet of blockkv serve nodes by what each holds (arguments go to "
             "blockkv.router.route)",
    "bench": "run tools/bench.py from a source checkout (arguments go to it)",
}


# where each command's main lives (bench: tools/bench.py, loaded from the checkout)
MODULES = {"demo": "blockkv.mlx_lm.demo", "serve": "blockkv.node.serve", "route": "blockkv.router.route"}


def load_bench() -> Any:
    """tools/ is not part of the installed package: load tools/bench.py from the
    source checkout this package was installed from (editable installs)."""
    path = Path(__file__).resolve().parents[2] / "tools" / "bench.py"
    spec = importlib.util.spec_from_file_location("blockkv_tools_bench", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise UsageError(f"bench needs a source checkout: {path} not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def run_passthrough(name: str, argv: list[str]) -> int:
    """Hand the rest of the command line, untouched, to the module's own main;
    imported only now so ``blockkv stats`` never imports mlx-lm's server."""
    try:
        module = load_bench() if name == "bench" else importlib.import_module(MODULES[name])
    except UsageError as exc:
        print(f"blockkv {name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return int(module.main(argv))
