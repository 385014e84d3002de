"""mlx-lm 0.32.2's own ``tests/test_server.py`` against plain ``mlx_lm.server`` and ``blockkv serve``.

    PYTHONPATH=$PWD python tools/mlx_lm_server_suite.py [--work DIR] [--json OUT]

Fetches mlx-lm's sdist (``pip download``, cached in ``--work``, its sha256
checked), copies the suite beside ``mlx_lm_suite_conftest.py`` with its
Hugging Face model swapped for a tiny local one (``blockkv.model_dir``; the
suite's draft-model tests use the same model as their draft, as upstream), and
runs the whole file three times, each in a process of its own: (a) as it is,
on plain mlx-lm; (b) with its servers made ``blockkv serve``'s over a fresh
``--cache-dir``; (c) the same again on that cache directory (a restart).
Prints each test's outcome in the three runs, the ``insert_cache`` calls the
suite made per model key, the caches' spill counts, and the entries ``blockkv
ls`` finds on disk after each blockkv run. ``--draft-served-alone``: the suite's
draft-model server serves each request alone, as mlx-lm's own provider does with
a draft model (the suite's provider leaves it batchable, so mlx-lm's batched
path serves its draft-model tests without the draft). Exit 1 if a test passing on plain
mlx-lm fails on blockkv, or an insert of a served model did not reach the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

MLX_LM_VERSION = "0.32.2"
SDIST_SHA256 = "1af8a92f6a141c3e2bf5b0369ac4464203a8e2189c47b9e40d3e921e5b3a1fe9"
SUITE_MODEL = "mlx-community/Qwen1.5-0.5B-Chat-4bit"
HERE = Path(__file__).resolve().parent
# run name -> blockkv serve flags (None: plain mlx-lm). Every blockkv run uses the same --cache-dir; the
# suite's prompts are shorter than serve's default --min-restore-tokens (one block), so only the last
# run restores from the disk.
RUNS: dict[str, str | None] = {"plain": None, "blockkv fresh": "", "blockkv restarted": "",
                               "blockkv restarted --min-restore-tokens 1": "--min-restore-tokens 1"}


def fetch_suite(cache: Path) -> str:
    """The text of mlx-lm's ``tests/test_server.py`` from its sdist (downloaded once into ``cache``)."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"mlx_lm-{MLX_LM_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"mlx-lm=={MLX_LM_VERSION}", "-d", str(cache)], check=True)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256}")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"mlx_lm-{MLX_LM_VERSION}/tests/test_server.py")
        assert member is not None
        return member.read().decode()


def prepare(work: Path, suite: str) -> Path:
    """A directory holding the suite, its model swapped for a tiny local one, and the conftest."""
    from blockkv.model_dir import build_model_dir

    # head_dim 64 (Qwen1.5-0.5B's): the suite's --kv-bits 4 quantizes in groups of 64
    model = build_model_dir(work / "model", overrides={"hidden_size": 128})
    if suite.count(SUITE_MODEL) != 1:
        raise SystemExit(f"the suite names {SUITE_MODEL} {suite.count(SUITE_MODEL)} times, expected once")
    tests = work / "suite"
    shutil.rmtree(tests, ignore_errors=True)
    tests.mkdir(parents=True)
    (tests / "test_server.py").write_text(suite.replace(SUITE_MODEL, str(model)))
    shutil.copy(HERE / "mlx_lm_suite_conftest.py", tests / "conftest.py")
    return tests


def run_suite(tests: Path, out: Path, cache_dir: Path, flags: str | None, draft_alone: bool
              ) -> tuple[dict[str, str], dict]:
    """Run the suite in a process of its own (on blockkv serve with ``flags`` unless None):
    each test's outcome, and the conftest's counts."""
    env = dict(os.environ, BLOCKKV_SUITE_DRAFT_ALONE="1" if draft_alone else "")
    report = out.with_suffix(".counts.json")
    report.unlink(missing_ok=True)
    if flags is not None:
        env.update(BLOCKKV_SUITE_CACHE_DIR=str(cache_dir), BLOCKKV_SUITE_REPORT=str(report),
                   BLOCKKV_SUITE_SERVE_FLAGS=flags)
    xml = out.with_suffix(".xml")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    str(tests / "test_server.py")], cwd=tests, env=env, check=False)
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    counts = json.loads(report.read_text()) if report.exists() else {}
    return outcomes, counts


def disk_entries(cache_dir: Path) -> int:
    """How many entries ``blockkv ls`` lists under ``cache_dir`` (every fingerprint)."""
    listed = subprocess.run([sys.executable, "-m", "blockkv", "ls", "--all", "--json", str(cache_dir)],
                            capture_output=True, text=True, check=True)
    data = json.loads(listed.stdout)
    return len(data["entries"] if isinstance(data, dict) else data)


def run_all(work: Path, draft_served_alone: bool = False, runs: tuple[str, ...] = tuple(RUNS)) -> dict[str, dict]:
    """``runs`` of ``RUNS`` (plain first), in order, in ``work``: each test's outcome,
    the conftest's counts, the entries on disk."""
    work = work.resolve()
    tests = prepare(work, fetch_suite(work / "sdist"))
    cache_dir = work / ("cache-draft-alone" if draft_served_alone else "cache")
    shutil.rmtree(cache_dir, ignore_errors=True)
    results: dict[str, dict] = {}
    for run in runs:
        flags = RUNS[run]
        out = work / f"{'draft-alone-' if draft_served_alone else ''}{run.replace(' ', '-')}"
        outcomes, counts = run_suite(tests, out, cache_dir, flags, draft_served_alone)
        results[run] = {"outcomes": outcomes, "counts": counts,
                        "disk_entries": None if flags is None else disk_entries(cache_dir)}
    return results


def regressions(results: dict[str, dict]) -> list[str]:
    """``run: test`` for each test passing on plain mlx-lm that did not pass on a blockkv run."""
    plain = results["plain"]["outcomes"]
    return [f"{run}: {name}" for run in list(results)[1:] for name, outcome in sorted(plain.items())
            if outcome == "passed" and results[run]["outcomes"].get(name) != "passed"]


def lost_inserts(results: dict[str, dict]) -> dict[str, list]:
    """Per blockkv run, the inserts of the served model that did not reach the disk, and the
    failed or RAM-only spills (mlx-lm's unit tests' mock caches, keyed by no model, aside)."""
    lost = {}
    for run in list(results)[1:]:
        counts = results[run]["counts"]
        stats = counts.get("tier_stats", {})
        lost[run] = [m for m in counts.get("not_on_disk", []) if "no store" not in m.get("why", "")]
        lost[run] += [f"{stats.get(k)} {k}" for k in ("spill_failures", "ram_only_inserts") if stats.get(k) != 0]
    return lost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/blockkv-mlx-lm-suite"))
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--draft-served-alone", action="store_true",
                        help="the suite's draft-model server serves each request alone, as mlx-lm's own provider "
                        "does with a draft model (the suite's leaves it batchable, so its batched path never "
                        "uses the draft)")
    args = parser.parse_args()
    results = run_all(args.work, args.draft_served_alone)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return report(results)


def report(results: dict[str, dict]) -> int:
    """Print the table and the counts; 1 if blockkv lost a test or an entry."""
    plain, runs = results["plain"]["outcomes"], list(results)
    print(f"\n| test | {' | '.join(runs)} |\n|{'---|' * (len(runs) + 1)}")
    for name in sorted(plain):
        print(f"| {name} | {' | '.join(results[run]['outcomes'].get(name, 'missing') for run in runs)} |")
    for run in runs[1:]:
        counts = results[run]["counts"]
        stats = counts.get("tier_stats", {})
        print(f"\n{run}: inserts per model key {counts.get('inserts')}, by caches per entry "
              f"{counts.get('inserts_by_caches')}; spills {stats.get('spills')}, already on disk "
              f"{stats.get('spills_skipped')}, failed {stats.get('spill_failures')}, RAM-only "
              f"{stats.get('ram_only_inserts')}; disk hits {stats.get('disk_hits')} ({stats.get('tokens_from_disk')} "
              f"tokens), misfits {stats.get('misfits')}; entries on disk after the run: "
              f"{results[run]['disk_entries']}; on disk, by tokens short of mlx-lm's key: "
              f"{counts.get('on_disk_short_of_the_key_by')}")
    lost, lost_tests = lost_inserts(results), regressions(results)
    print(f"\ntests passing on plain mlx-lm that fail on blockkv: {lost_tests or 'none'}")
    print(f"inserts of the served model not on disk: {lost}")
    return 1 if lost_tests or any(lost.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
