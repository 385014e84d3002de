"""User-space instructions of a verified restore, an unverified one and
mlx-lm's load of the same cache, counted by ``valgrind --tool=callgrind``:
repeatable whatever else runs on the machine, as no time figure is (issue
#45). Each runs in a child under valgrind, which loads once to warm up, then
waits while its counts are zeroed (``callgrind_control -z``), runs ``--reps``
loads, and waits again while they are dumped (``-d``). The kernel's work (the
copy inside ``read``/``preadv``, page faults) is not counted: callgrind sees
user space only. Several minutes per child.

    python tools/restore_instructions.py                 # 4,096 tokens, 2 loads each
    python tools/restore_instructions.py --tokens 1024 --modes verified mlx
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchmarks/

_setrlimit = resource.setrlimit


def _tolerant_setrlimit(which: int, limits: tuple[int, int]) -> None:
    """mlx_lm raises its open-file limit on import, which valgrind (keeping fds of its own) refuses."""
    try:
        _setrlimit(which, limits)
    except ValueError:
        pass


def _wait_for(path: Path, child: subprocess.Popen[bytes] | None = None) -> None:
    while not path.exists():
        if child is not None and child.poll() is not None:
            raise RuntimeError(f"the child under valgrind exited ({child.returncode}) before {path.name}")
        time.sleep(0.2)


def child(mode: str, tokens: int, work: Path, reps: int) -> None:
    """Under valgrind: one warm load, then ``reps`` between the driver's zero and dump."""
    resource.setrlimit = _tolerant_setrlimit
    from benchmarks.config import FULL
    from benchmarks.harness import open_store
    from benchmarks.sources import KVSource, eval_caches
    from mlx_lm.models.cache import load_prompt_cache

    src = KVSource.random(FULL.shape, tokens, seed=1)
    with open_store(work / "root", FULL.block_tokens, verify=mode == "verified") as store:
        entry = store.find_exact(src.tokens).entry
        load = {"mlx": lambda: eval_caches(load_prompt_cache(str(work / "mlx.safetensors"))),
                "verified": lambda: eval_caches(store.restore(entry).caches),
                "unverified": lambda: eval_caches(store.restore(entry).caches)}[mode]
        load()
        (work / "ready").touch()
        _wait_for(work / "go")
        for _ in range(reps):
            load()
        (work / "done").touch()
        _wait_for(work / "exit")


def count(mode: str, tokens: int, work: Path, reps: int) -> int:
    """User-space instructions of one of ``mode``'s loads, the mean of ``reps``."""
    for marker in ("ready", "go", "done", "exit"):
        (work / marker).unlink(missing_ok=True)
    out = work / f"callgrind.{mode}"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
           "--child", mode, "--tokens", str(tokens), "--reps", str(reps), "--work", str(work)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(work / "ready", proc)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        (work / "go").touch()
        _wait_for(work / "done", proc)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        (work / "exit").touch()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    dump = Path(f"{out}.1").read_text(errors="replace")
    return int(re.search(r"^summary: (\d+)", dump, re.MULTILINE).group(1)) // reps  # type: ignore[union-attr]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["verified", "unverified", "mlx"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokens, args.work, args.reps)
        return 0
    from benchmarks.config import FULL
    from benchmarks.harness import open_store
    from benchmarks.sources import KVSource
    from mlx_lm.models.cache import save_prompt_cache

    rows = ["| load | user-space instructions, each |", "|---|---|"]
    with tempfile.TemporaryDirectory(prefix="blockkv-instr-") as tmp:
        work = Path(tmp)
        src = KVSource.random(FULL.shape, args.tokens, seed=1)
        save_prompt_cache(str(work / "mlx.safetensors"), src.caches())
        with open_store(work / "root", FULL.block_tokens) as store:
            assert store.store(src.tokens, src.caches()), "store refused"
        for mode in args.modes:
            rows.append(f"| {mode} ({args.tokens} tokens) | {count(mode, args.tokens, work, args.reps) / 1e6:.1f} M |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
