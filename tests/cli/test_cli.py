"""The ``blockkv`` console script, run as users run it: a subprocess of the
installed entry point over a cache root filled by a real BlockStore with real
mlx-lm caches from two tiny models, then damaged the way disks get damaged."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from blockkv import BlockStore, list_fingerprints
from blockkv.human import format_size, parse_size
from blockkv.mlx_lm.identity import KVQuant, readable_fingerprint

SCRIPT = Path(sys.executable).with_name("blockkv")
Command = Sequence[str | os.PathLike[str]]
LOCKS = {"LOCK", "lock.mdb"}  # lock state, not content: opening a store may rewrite them


@dataclass(frozen=True)
class Model:
    """What the fixture stored for one model, for the tests to compare against."""

    model_id: str
    fingerprint: str
    namespaces: frozenset[str]
    token_counts: tuple[int, ...]


@dataclass(frozen=True)
class Root:
    path: Path
    llama: Model
    mamba: Model

    def fp_dir(self, model: Model) -> Path:
        (ident,) = [i for i in list_fingerprints(self.path) if i.model_id == model.model_id]
        return ident.path


def run_all(
    *commands: Command, module: bool = False, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run independent commands through the real console entry point (or
    ``python -m blockkv``) at once: each process spends most of its time
    importing mlx-lm, and two cores halve that."""
    prefix = [sys.executable, "-m", "blockkv"] if module else [str(SCRIPT)]
    procs = [
        subprocess.Popen([*prefix, *map(str, cmd)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for cmd in commands
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def run(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return run_all(args)[0]


def parsed(proc: subprocess.CompletedProcess[str], expect: int = 0) -> dict[str, Any]:
    assert proc.returncode == expect, (proc.args, proc.stderr)
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def run_json(*args: str | os.PathLike[str], expect: int = 0) -> dict[str, Any]:
    return parsed(run(*args, "--json"), expect)


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` by relative name → content digest."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name not in LOCKS
    }


def entry_bytes(fp_dir: Path) -> int:
    """Headers plus blocks, counted from the files themselves."""
    return sum(
        p.stat().st_size
        for sub in ("entries", "blobs")
        for p in (fp_dir / sub).rglob("*")
        if p.is_file() and not p.name.endswith(".tmp")
    )


def disk_bytes(fp_dir: Path) -> int:
    """What every command calls "on disk" (docs/cli.md): the apparent size of every file in the directory."""
    return sum(p.lstat().st_size for p in fp_dir.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Root:
    """Two models' real caches in one root: llama with shared prefixes in two
    namespaces and a generation checkpoint (so blocks dedup), mamba alongside."""
    from blockkv import GenerationCheckpoint
    from blockkv.testing.models import prefill, random_tokens, tiny_model

    root = tmp_path_factory.mktemp("cli") / "cache"
    root.mkdir()
    base = random_tokens(96, seed=1)
    extra = random_tokens(40, seed=2)

    def fill(kind: str, model_id: str, fingerprint: str, ns_list: Sequence[str]) -> Model:
        model = tiny_model(kind)
        with BlockStore(
            root, model_id=model_id, config_fingerprint=fingerprint,
            tokenizer_hash=f"tok-{kind}", max_bytes=1 << 30, block_tokens=16,
        ) as store:
            cache, _ = prefill(model, base)
            for ns in ns_list:
                assert store.store(base, cache, ns=ns)
            if len(ns_list) > 1:
                cache, _ = prefill(model, extra, cache=cache)
                assert store.store(base + extra, cache, ns=ns_list[-1])
                checkpoint = GenerationCheckpoint(key="req-1", original_prompt_tokens=len(base))
                assert store.store_generation_checkpoint(base + extra, cache, checkpoint)
            # What the store itself says it holds is what the CLI must show.
            entries = store.entries()
        return Model(model_id, fingerprint, frozenset(e.ns for e in entries),
                     tuple(sorted(e.length for e in entries)))

    # llama's fingerprint is the readable one serve writes; mamba's a library user's own string
    llama = fill("llama", "tiny-llama", readable_fingerprint("tiny-llama", KVQuant(), None, "a1b2"), ["", "chat"])
    mamba = fill("mamba", "tiny-mamba", "fp-mamba-c3d4", [""])
    return Root(root, llama, mamba)


@pytest.fixture
def root(built: Root, tmp_path: Path) -> Root:
    """A private copy of the built root, so a test may damage it."""
    copy = tmp_path / "cache"
    shutil.copytree(built.path, copy)
    return Root(copy, built.llama, built.mamba)


# -- read commands, all at once on the shared root ----------------------------------


@dataclass(frozen=True)
class Reads:
    results: dict[str, subprocess.CompletedProcess[str]]
    before: dict[str, str]
    after: dict[str, str]
    home: Path


@pytest.fixture(scope="module")
def reads(built: Root, tmp_path_factory: pytest.TempPathFactory) -> Reads:
    """Every read-only and every bad-input command, run concurrently once."""
    tmp = tmp_path_factory.mktemp("bad")
    afile = tmp / "not-a-dir"
    afile.write_text("x")
    home = tmp / "home"  # somebody's directory, not a cache root
    home.mkdir()
    (home / "precious.txt").write_text("keep me")
    r = built.path
    commands: dict[str, Command] = {
        "stats": ["stats", r],
        "stats_json": ["stats", r, "--json", "--cap", "1G"],
        "ls_chat": ["ls", r, "-f", built.llama.fingerprint, "-n", "chat", "--json"],
        "ls_json": ["ls", r, "--json"],
        "ls_mamba": ["ls", r, "-f", built.mamba.fingerprint[:8]],
        "ls_model": ["ls", r, "-f", built.llama.model_id, "--json"],
        "stats_model_prefix": ["stats", r, "-f", "tiny-ma", "--json"],
        "check_json": ["check", r, "--json"],
        "check_progress": ["check", r, "-f", built.mamba.fingerprint, "--progress"],
        "dry_run": ["evict", r, "--all", "--to", "0", "--dry-run"],
        # bad input: each must be one line on stderr and exit 2
        "bad_missing_root": ["stats", tmp / "missing"],
        "bad_file_root": ["ls", afile],
        "bad_foreign_root": ["gc", home, "--all", "--grace", "0"],
        "bad_unknown_fingerprint": ["stats", r, "-f", "no-such-fingerprint"],
        "bad_ambiguous_fingerprint": ["ls", r, "-f", "tiny-"],
        "bad_option": ["stats", r, "--bogus"],
        "bad_negative_size": ["evict", r, "--all", "--to", "-5G"],
        "bad_size": ["evict", r, "--all", "--to", "lots"],
        "bad_unnamed_gc": ["gc", r],
        "bad_unnamed_repair": ["check", r, "--repair"],
        "bad_command": ["frobnicate", r],
        "bad_route_node": ["route", "--model", r, "--node", "ftp://127.0.0.1:1"],
    }
    passthrough = {name: [name, "--help"] for name in ("demo", "serve", "route", "bench")}
    before = tree(r)
    procs = run_all(*commands.values(), *passthrough.values())
    [module] = run_all(["stats", r, "--json"], module=True)
    # Python lists every import on stderr: stats must not pull in mlx-lm's server.
    [imports] = run_all(["stats", r], env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    results = dict(zip([*commands, *passthrough], procs, strict=True))
    results.update(module=module, imports=imports)
    return Reads(results, before, tree(r), home)


BAD = [
    "bad_missing_root", "bad_file_root", "bad_foreign_root", "bad_unknown_fingerprint",
    "bad_ambiguous_fingerprint", "bad_negative_size", "bad_size", "bad_unnamed_gc",
    "bad_unnamed_repair", "bad_command", "bad_option", "bad_route_node",
]


def test_read_commands_change_nothing(reads: Reads) -> None:
    assert reads.after == reads.before
    assert (reads.home / "precious.txt").read_text() == "keep me"


def test_stats_reports_each_model_as_the_files_say(built: Root, reads: Reads) -> None:
    out = parsed(reads.results["stats_json"])
    by_model = {fp["model_id"]: fp for fp in out["fingerprints"]}
    assert set(by_model) == {built.llama.model_id, built.mamba.model_id}
    for model in (built.llama, built.mamba):
        fp = by_model[model.model_id]
        fp_dir = built.fp_dir(model)
        assert fp["config_fingerprint"] == model.fingerprint
        assert fp["entries"] == len(model.token_counts)
        assert fp["disk_bytes"] == disk_bytes(fp_dir)
        assert fp["blocks"] == sum(1 for p in (fp_dir / "blobs").rglob("*") if p.is_file())
        assert fp["cap_bytes"] == parse_size("1G")
        assert {ns["ns"] for ns in fp["namespaces"]} == model.namespaces
        assert sum(ns["entries"] for ns in fp["namespaces"]) == fp["entries"]
        assert fp["oldest_use"] <= fp["newest_use"]
    llama = by_model[built.llama.model_id]
    # Entries over one shared prefix: file-per-entry would take more than the pool.
    assert llama["entry_bytes"] == entry_bytes(built.fp_dir(built.llama))
    assert llama["logical_bytes"] > llama["entry_bytes"]
    assert llama["dedup_ratio"] == pytest.approx(llama["logical_bytes"] / llama["entry_bytes"])

    table = reads.results["stats"]
    assert table.returncode == 0, table.stderr
    for model in (built.llama, built.mamba):
        assert model.model_id in table.stdout
    assert '"chat"' in table.stdout and format_size(llama["disk_bytes"]) in table.stdout


def test_python_dash_m_is_the_same_entry_point(reads: Reads) -> None:
    assert parsed(reads.results["module"])["fingerprints"] == [
        {**fp, "cap_bytes": None} for fp in parsed(reads.results["stats_json"])["fingerprints"]
    ]


def test_ls_filters_by_fingerprint_and_namespace(built: Root, reads: Reads) -> None:
    rows = parsed(reads.results["ls_chat"])["entries"]
    assert {r["ns"] for r in rows} == {"chat"}
    assert {r["model_id"] for r in rows} == {built.llama.model_id}
    every = parsed(reads.results["ls_json"])["entries"]
    uses = [r["last_use"] for r in every]
    assert uses == sorted(uses)  # eviction order
    assert sorted(r["tokens"] for r in every) == sorted(
        built.llama.token_counts + built.mamba.token_counts
    )
    assert [r["checkpoint"]["key"] for r in every if r["checkpoint"]] == ["req-1"]

    table = reads.results["ls_mamba"]
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:6] == ["FINGERPRINT", "MODEL", "KV", "TEMPLATE", "NAMESPACE", "ENTRY"]
    assert len(lines) == 1 + len(built.mamba.token_counts)


def test_fingerprints_are_named_and_described_in_the_users_words(built: Root, reads: Reads) -> None:
    """-f takes a model id or its unique prefix; stats and ls say which model,
    KV quantisation and chat template each store is (when its fingerprint says)."""
    rows = parsed(reads.results["ls_model"])["entries"]
    assert {r["model_id"] for r in rows} == {built.llama.model_id}
    assert sorted(r["tokens"] for r in rows) == sorted(built.llama.token_counts)
    assert {(r["kv_quantisation"], r["chat_template"]) for r in rows} == {("off", "builtin")}
    (mamba,) = parsed(reads.results["stats_model_prefix"])["fingerprints"]
    assert mamba["model_id"] == built.mamba.model_id
    assert (mamba["kv_quantisation"], mamba["chat_template"]) == (None, None)  # a library user's string
    by_model = {fp["model_id"]: fp for fp in parsed(reads.results["stats_json"])["fingerprints"]}
    assert (by_model["tiny-llama"]["kv_quantisation"], by_model["tiny-llama"]["chat_template"]) == ("off", "builtin")
    assert Path(by_model["tiny-llama"]["dir"]).name.startswith("tiny-llama_kv-off_template-builtin")
    table = reads.results["stats"].stdout.splitlines()
    assert table[2].split()[:4] == ["FINGERPRINT", "MODEL", "KV", "TEMPLATE"]
    llama_row = next(line for line in table if line.startswith("tiny-llama"))
    assert llama_row.split()[1:4] == ["tiny-llama", "off", "builtin"]
    assert "ambiguous" in reads.results["bad_ambiguous_fingerprint"].stderr
    assert "tiny-llama, kv off, template builtin" in reads.results["bad_ambiguous_fingerprint"].stderr


def test_check_of_a_sound_root_is_clean_with_a_progress_bar(built: Root, reads: Reads) -> None:
    out = parsed(reads.results["check_json"])
    assert out["clean"] is True and len(out["fingerprints"]) == 2
    proc = reads.results["check_progress"]
    assert proc.returncode == 0, proc.stderr
    blocks = sum(1 for p in (built.fp_dir(built.mamba) / "blobs").rglob("*") if p.is_file())
    assert f"{blocks}/{blocks}" in proc.stderr and "ok" in proc.stdout


def test_evict_dry_run_plans_every_entry_and_deletes_nothing(built: Root, reads: Reads) -> None:
    proc = reads.results["dry_run"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("would remove") == 2
    assert proc.stdout.count("\n  ") == len(built.llama.token_counts + built.mamba.token_counts) + 2


@pytest.mark.parametrize("name", ["demo", "serve", "route", "bench"])
def test_demo_serve_route_bench_get_the_rest_of_the_command_line(reads: Reads, name: str) -> None:
    proc = reads.results[name]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: blockkv {name}")


def test_stats_does_not_import_the_server(reads: Reads) -> None:
    proc = reads.results["imports"]
    assert proc.returncode == 0
    assert "blockkv.local.reader" in proc.stderr and "mlx_lm.server" not in proc.stderr
    assert "blockkv.router.route" not in proc.stderr


def test_help_ls_stats_and_import_blockkv_do_not_import_mlx_lm(built: Root) -> None:
    """Scripts call ``ls``/``stats`` often; mlx-lm (and transformers) cost ~1 s
    to import. Each command runs in a fresh interpreter, which then lists its modules."""
    run_cli = "from blockkv.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
    bodies = {
        "--help": run_cli.format(argv=["--help"]),
        "ls": run_cli.format(argv=["ls", str(built.path)]),
        "stats": run_cli.format(argv=["stats", str(built.path), "--json"]),
        "import blockkv": "import blockkv",
        "BlockStore": "from blockkv import BlockStore, Entry, list_fingerprints",
    }
    report = "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    procs = {name: subprocess.Popen([sys.executable, "-c", body + report], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True) for name, body in bodies.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err)
        modules = set(json.loads(err.splitlines()[-1]))
        assert "blockkv" in modules, name
        heavy = {m for m in modules if m.split(".")[0] in ("mlx_lm", "transformers")}
        assert not heavy, (name, sorted(heavy)[:5])


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_exit_2(reads: Reads, name: str) -> None:
    proc = reads.results[name]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    command = proc.args[1] if name != "bad_command" else ""
    assert proc.stderr.startswith(f"blockkv {command}: error:".replace(" :", ":")), proc.stderr


# -- commands that change a root, each on its own copy ------------------------------------


def plant_faults(root: Root) -> tuple[Path, Path]:
    """A flipped byte in a llama block, a valid block nobody in llama references,
    and mamba's LMDB environment deleted and a byte of one of its headers flipped."""
    llama_dir, mamba_dir = root.fp_dir(root.llama), root.fp_dir(root.mamba)
    victim = next(p for p in sorted((llama_dir / "blobs").rglob("*")) if p.is_file())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    # A sound block of the other model: valid bytes under its true name, unreferenced here.
    stray = next(p for p in sorted((mamba_dir / "blobs").rglob("*")) if p.is_file())
    orphan = llama_dir / "blobs" / stray.parent.name / stray.name
    orphan.parent.mkdir(exist_ok=True)
    shutil.copyfile(stray, orphan)
    shutil.rmtree(mamba_dir / "index")
    header = sorted(mamba_dir.glob("entries/*/*.bkv"))[0]
    data = bytearray(header.read_bytes())
    data[len(data) // 2] ^= 0xFF
    header.write_bytes(bytes(data))
    return victim, orphan


def test_check_reports_planted_faults_and_repair_fixes_them(root: Root) -> None:
    victim, orphan = plant_faults(root)
    stranger = root.path / "not-ours"  # an IDENTITY no store can read: report, never touch
    stranger.mkdir()
    (stranger / "IDENTITY").write_text("{")
    before = tree(root.path)
    as_json, human = run_all(["check", root.path, "--json"], ["check", root.path])
    report = parsed(as_json, expect=1)
    assert report["clean"] is False
    assert report["unreadable_dirs"] == [str(stranger)]
    by_model = {fp["model_id"]: fp["report"] for fp in report["fingerprints"]}
    llama, mamba = by_model[root.llama.model_id], by_model[root.mamba.model_id]
    assert llama["corrupt_blocks"] == [victim.name]
    assert llama["orphan_blocks"] == [orphan.name]
    assert llama["dangling"]  # the entries that need the corrupt block
    assert mamba["index_missing"] is True and mamba["clean"] is False
    assert human.returncode == 1
    assert victim.name in human.stdout and orphan.name in human.stdout
    assert "index missing" in human.stdout
    assert tree(root.path) == before  # check without --repair changed nothing

    mamba_dir = root.fp_dir(root.mamba)
    fixed = run("check", root.path, "--repair", "-f", root.llama.fingerprint)
    assert fixed.returncode == 1, fixed.stderr  # problems were found (and repaired)
    assert "repaired:" in fixed.stdout
    assert not orphan.exists() and not victim.exists()
    assert not (mamba_dir / "index").exists()  # only the named fingerprint was touched
    # The dangling entries are gone, so blocks only they used await gc: it says so, and gc agrees.
    hint = re.search(r"(\d+) block\(s\) no longer referenced: 'blockkv gc -f (\S+)'", fixed.stdout)
    assert hint is not None and int(hint.group(1)) > 0, fixed.stdout
    (gc,) = run_json("gc", root.path, "-f", hint.group(2), "--grace", "0")["fingerprints"]
    assert gc["blocks_deleted"] == int(hint.group(1))

    fixed_all = run_json("check", root.path, "--repair", "--all", expect=1)
    (mamba_actions,) = [fp["report"]["actions"] for fp in fixed_all["fingerprints"]
                        if fp["model_id"] == root.mamba.model_id]
    # what opening the store deleted (rebuilding the lost index) is reported too, the rebuild once
    assert any(a.startswith("removed corrupt header") for a in mamba_actions), mamba_actions
    assert len([a for a in mamba_actions if "rebuilt" in a]) == 1, mamba_actions
    assert (stranger / "IDENTITY").read_text() == "{"
    shutil.rmtree(stranger)
    assert run_json("check", root.path)["clean"] is True


def every_path(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``root``: its type, size and mtime, and a file's content digest."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def plant_recovery_work(fp_dir: Path) -> None:
    """What opening a store would clean up: a corrupt header, a dead writer's
    temp files and intent file, an unreferenced block that is not one, and a
    dead store's pending references."""
    header = next((fp_dir / "entries").rglob("*.bkv"))
    data = bytearray(header.read_bytes())
    data[len(data) // 2] ^= 0x40
    (header.parent / ("ab" * 16 + ".bkv")).write_bytes(bytes(data))
    dead = "w0123456789abcdef"
    (fp_dir / "writers" / dead).write_bytes(b"")
    block = next(p for p in (fp_dir / "blobs").rglob("*") if p.is_file())
    (block.parent / f".{block.name}.{dead}.0badf00d.tmp").write_bytes(block.read_bytes()[:10])
    (header.parent / f".{'cd' * 16}.bkv.{dead}.deadbeef.tmp").write_bytes(b"half a header")
    (fp_dir / "blobs" / "ee" / ("ee" + "0" * 62)).write_bytes(b"not a block")
    with BlockStore.open_dir(fp_dir) as store:
        store._index.take_refs("ff" * 16, "entries/x/y.bkv", {block.name: block.stat().st_size})


def test_read_commands_and_dry_runs_leave_a_damaged_root_byte_for_byte(root: Root) -> None:
    """``ls``, ``stats``, ``check`` without ``--repair`` and ``evict --dry-run``
    have no recovery side effect: every path, size, mtime and content stays
    (llama's directory with work for recovery, mamba's without its index)."""
    plant_recovery_work(root.fp_dir(root.llama))
    plant_faults(root)
    before = every_path(root.path)
    r, fp = root.path, root.llama.fingerprint
    procs = run_all(["evict", r, "-f", fp, "--to", "0", "--dry-run"], ["evict", r, "--all", "--to", "1", "--dry-run", "--json"],
                    ["ls", r], ["ls", r, "--json"], ["stats", r], ["stats", r, "--json"],
                    ["check", r], ["check", r, "-f", fp, "--json"])
    assert [p.returncode for p in procs] == [0] * 6 + [1, 1], [p.stderr for p in procs]
    assert "would remove" in procs[0].stdout
    assert every_path(root.path) == before


def test_evict_gc_and_rebuild_index_touch_only_the_named_fingerprint(root: Root) -> None:
    llama_dir, mamba_dir = root.fp_dir(root.llama), root.fp_dir(root.mamba)
    mamba_before = tree(mamba_dir)
    held = entry_bytes(llama_dir)  # the entries' headers and blocks; the index and bookkeeping stay whatever goes
    target = disk_bytes(llama_dir) - held // 2
    evict: list[str | Path] = ["evict", root.path, "-f", root.llama.fingerprint]
    evict += ["--to", str(target)]
    before = tree(root.path)
    dry, dry_human = run_all([*evict, "--dry-run", "--json"], [*evict, "--dry-run"])
    assert tree(root.path) == before
    (plan,) = parsed(dry)["fingerprints"]
    planned = [e["id"] for e in plan["entries"]]
    assert planned, "half the bytes cannot fit without removing something"
    assert "would remove" in dry_human.stdout and all(i in dry_human.stdout for i in planned)

    (done,) = run_json(*evict)["fingerprints"]
    assert [e["id"] for e in done["entries"]] == planned
    assert done["disk_bytes_after"] == disk_bytes(llama_dir) and done["blocks_released"] > 0  # blocks wait for gc
    with BlockStore.open_dir(llama_dir) as store:
        assert {e.id for e in store.entries()}.isdisjoint(planned)
    # the blocks only they used wait out the grace: a plain check names them, their bytes and a gc that works
    looked = run_json("check", root.path, "-f", root.llama.fingerprint)["fingerprints"][0]
    assert looked["blocks_awaiting_gc"] == done["blocks_released"] and looked["bytes_awaiting_gc"] > 0
    hint = re.search(r"'(blockkv gc -f \S+)' deletes them .*they hold", run("check", root.path).stdout)
    assert hint is not None
    assert run(*hint.group(1).split()[1:], root.path).returncode == 0  # the command as printed works

    (gc,) = run_json("gc", root.path, "-f", root.llama.fingerprint, "--grace", "0")["fingerprints"]
    assert gc["blocks_deleted"] == done["blocks_released"]  # those only the evicted entries used
    assert gc["disk_bytes"] == disk_bytes(llama_dir)
    assert entry_bytes(llama_dir) <= held // 2  # what the entries held fits in what the target left them

    shutil.rmtree(llama_dir / "index")
    (rebuilt,) = run_json("rebuild-index", root.path, "-f", root.llama.fingerprint)["fingerprints"]
    with BlockStore.open_dir(llama_dir) as store:
        kept = len(root.llama.token_counts) - len(planned)
        assert rebuilt["entries_indexed"] == len(store) == kept
    assert tree(mamba_dir) == mamba_before
    assert run_json("check", root.path)["clean"] is True


# -- tools that only look ---------------------------------------------------------------


def snapshot(path: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every file, directory and link under ``path``: its mode and, for a file, its bytes."""
    out: dict[str, tuple[int, bytes | None]] = {}
    for p in sorted(path.rglob("*")):
        mode = p.lstat().st_mode
        out[str(p.relative_to(path))] = (mode, p.read_bytes() if stat.S_ISREG(mode) else None)
    return out


def test_ls_and_stats_with_a_lost_index_and_a_corrupt_header_change_nothing(root: Root, tmp_path: Path) -> None:
    """Opening a store there would rebuild the index and delete the header; the
    tools that only look list the entries as the files say and touch nothing."""
    llama_dir = root.fp_dir(root.llama)
    shutil.rmtree(llama_dir / "index")
    header = sorted((llama_dir / "entries").rglob("*.bkv"))[0]
    data = bytearray(header.read_bytes())
    data[len(data) // 2] ^= 0xFF
    header.write_bytes(bytes(data))
    untouched = tmp_path / "untouched"
    shutil.copytree(root.path, untouched)
    before = snapshot(root.path)
    ls_json, ls_text, stats_json, stats_text, check = run_all(
        ["ls", root.path, "--json"], ["ls", root.path], ["stats", root.path, "--json"],
        ["stats", root.path], ["check", root.path, "--json"],
    )
    assert snapshot(root.path) == before
    assert ls_text.returncode == 0 and stats_text.returncode == 0, (ls_text.stderr, stats_text.stderr)
    assert "1 corrupt header(s)" in stats_text.stdout

    listed = {r["id"]: r for r in parsed(ls_json)["entries"] if r["model_id"] == root.llama.model_id}
    # What a store makes of the same files (on a copy: it deletes the header, rebuilds the index).
    with BlockStore.open_dir(untouched / llama_dir.name) as store:
        truth = {e.id: e for e in store.entries()}
        disk = store.total_bytes
    assert header.stem not in listed and len(listed) == len(root.llama.token_counts) - 1
    assert {i: (r["tokens"], r["nbytes"], r["blocks"]) for i, r in listed.items()} == {
        i: (e.length, e.nbytes, len(e.blocks)) for i, e in truth.items()
    }
    (llama,) = [fp for fp in parsed(stats_json)["fingerprints"] if fp["model_id"] == root.llama.model_id]
    assert llama["entry_bytes"] == disk and llama["entries"] == len(truth)
    assert llama["disk_bytes"] == disk_bytes(llama_dir)  # the corrupt header's bytes too: it is on disk
    assert llama["corrupt_headers"] == [str(header.relative_to(llama_dir))]
    report = parsed(check, expect=1)
    (llama_check,) = [fp["report"] for fp in report["fingerprints"] if fp["model_id"] == root.llama.model_id]
    assert llama_check["index_missing"] and llama_check["corrupt_headers"] == llama["corrupt_headers"]


_STOPPED_WRITER = """
import os, signal, sys
from blockkv import BlockStore
from blockkv.fs import FileLayer
from blockkv.testing.models import prefill, random_tokens, tiny_model


class StopInTheLock(FileLayer):
    def crash_point(self, name):
        if name == "store:header-written":  # inside the directory lock, as a store publishes its entry
            print("holding", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


tokens = random_tokens(50, seed=9)
caches, _ = prefill(tiny_model("llama"), tokens)
with BlockStore(sys.argv[1], model_id=sys.argv[2], config_fingerprint=sys.argv[3], tokenizer_hash="tok-llama",
                max_bytes=1 << 30, block_tokens=16, fs=StopInTheLock()) as store:
    store.store(tokens, caches)
"""


@contextmanager
def stopped_writer(script: str, root: Root, ready: str) -> Iterator[None]:
    """``script`` run on ``root``'s llama store, stopped once it prints ``ready``
    (SIGSTOP: a suspended laptop, a debugger), continued afterwards; it must then
    finish cleanly."""
    writer = subprocess.Popen([sys.executable, "-c", script, str(root.path), root.llama.model_id,
                               root.llama.fingerprint], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == ready + "\n"
        _, status = os.waitpid(writer.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        yield
    finally:
        writer.send_signal(signal.SIGCONT)
        writer.communicate(timeout=120)
    assert writer.returncode == 0


def test_read_commands_never_wait_without_bound_on_a_stopped_writer(root: Root, tmp_path: Path) -> None:
    """A writer stopped (SIGSTOP: a suspended laptop, a debugger) in the middle
    of a store holds the directory lock. ls, stats and export read without it;
    check waits --wait seconds for it, then says the root is busy (exit 75)."""
    with stopped_writer(_STOPPED_WRITER, root, "holding"):
        ls = run_json("ls", root.path, "-f", root.llama.fingerprint)
        entry = ls["fingerprints"][0]["entries"][0]["id"] if "fingerprints" in ls else ls["entries"][0]["id"]
        check, stats, export = run_all(
            ["check", root.path, "--wait", "1"], ["stats", root.path, "--json"],
            ["export", root.path, entry, "-f", root.llama.fingerprint, "-o", tmp_path / "x.safetensors"])
        assert check.returncode == 75, check.stderr
        assert check.stderr.startswith("blockkv check: busy: a writer holds") and "Traceback" not in check.stderr
        assert stats.returncode == 0 and export.returncode == 0, (stats.stderr, export.stderr)


_STOPPED_IN_TXN = """
import os, signal, sys
from blockkv import BlockStore

with BlockStore(sys.argv[1], model_id=sys.argv[2], config_fingerprint=sys.argv[3], tokenizer_hash="tok-llama",
                max_bytes=1 << 30, block_tokens=16) as store:
    def stop(txn):
        print("in-txn", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    with store._keeper.locked(5.0, 0.0):  # as a store's index write: both locks held
        store._keeper.index._env.write(stop)
"""


def test_check_behind_a_writer_stopped_in_an_index_transaction_says_busy(root: Root) -> None:
    """A writer stopped inside an index write transaction holds the index's
    lock as well as the directory's: ``check`` (plain or ``--repair``) says
    busy (exit 75) within its ``--wait``, never "index missing"; ``--wait inf``
    is a usage error, not a traceback."""
    with stopped_writer(_STOPPED_IN_TXN, root, "in-txn"):
        t0 = time.monotonic()
        plain, repair, forever = run_all(
            ["check", root.path, "-f", root.llama.fingerprint, "--wait", "1", "--json"],
            ["check", root.path, "-f", root.llama.fingerprint, "--repair", "--wait", "1"],
            ["check", root.path, "--wait", "inf"])
        took = time.monotonic() - t0
        for busy in (plain, repair):
            assert busy.returncode == 75, busy.stderr
            assert busy.stderr.startswith("blockkv check: busy: a writer holds"), busy.stderr
            assert "index_missing" not in busy.stdout and "Traceback" not in busy.stderr
        assert took < 30, took  # each wait bounded by --wait (the index lock waited 10 s, then "missing", before)
        assert forever.returncode == 2 and "finite" in forever.stderr and "Traceback" not in forever.stderr


def test_a_closed_pipe_ends_ls_quietly(built: Root) -> None:
    """``blockkv ls | head -1``: the reader leaving is not "problems found" (exit 1)."""
    proc = subprocess.Popen([SCRIPT, "ls", built.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the program writes a byte
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == -signal.SIGPIPE and err == b""
    shell = subprocess.run(
        ["bash", "-c", f'"{SCRIPT}" ls "{built.path}" | head -1; echo "status ${{PIPESTATUS[0]}}"'],
        capture_output=True, text=True, timeout=120,
    )
    first, status = shell.stdout.splitlines()
    assert first.startswith("FINGERPRINT") and status in ("status 0", "status 141"), shell.stdout
    assert shell.stderr == ""


def test_a_closed_pipe_lets_a_changing_command_finish(root: Root) -> None:
    """A command that changes a store is not killed mid-way by a closed pipe:
    it finishes, then exits 141, as a shell reports SIGPIPE."""
    proc = subprocess.Popen([SCRIPT, "evict", root.path, "-f", root.mamba.model_id, "--to", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""
    (mamba,) = run_json("stats", root.path, "-f", root.mamba.model_id)["fingerprints"]
    assert mamba["entries"] == 0  # the eviction was done


def test_check_names_the_owner_of_foreign_entries(tmp_path: Path) -> None:
    """Two stores sharing one fingerprint with different tokenizers never serve
    each other's entries; check and stats say whose they are."""
    from blockkv.testing.models import prefill, random_tokens, tiny_model

    root = tmp_path / "cache"
    tokens = random_tokens(40, seed=3)
    cache, _ = prefill(tiny_model("llama"), tokens)
    for model, tokenizer in (("m", "tok-first-aaaa"), ("m", "tok-second-bbbb"), ("renamed", "tok-first-aaaa")):
        with BlockStore(root, model_id=model, config_fingerprint="shared", tokenizer_hash=tokenizer,
                        max_bytes=1 << 30, block_tokens=16) as store:
            assert store.store(tokens, cache)
    text, as_json, stats, stats_text = run_all(["check", root], ["check", root, "--json"], ["stats", root, "--json"],
                                               ["stats", root])
    assert text.returncode == 0, text.stdout  # foreign entries are no fault
    assert "1 entries of another model id (renamed, tokenizer tok-first-aa)" in stats_text.stdout
    assert "1 entries of another tokenizer or chat template (m, tokenizer tok-second-b)" in stats_text.stdout
    by_tokenizer, by_model = (line for line in text.stdout.splitlines() if "foreign entries" in line)
    assert "1 foreign entries" in by_tokenizer and "tok-second-b" in by_tokenizer
    assert "different tokenizers" in by_tokenizer
    assert "'renamed'" in by_model and "different model ids" in by_model  # not "different tokenizers": they are one
    assert "different tokenizers" not in by_model
    owners = [{"model_id": "m", "config_fingerprint": "shared", "tokenizer_hash": "tok-second-bbbb", "entries": 1},
              {"model_id": "renamed", "config_fingerprint": "shared", "tokenizer_hash": "tok-first-aaaa", "entries": 1}]
    assert parsed(as_json)["fingerprints"][0]["foreign_owners"] == owners
    (fp,) = parsed(stats)["fingerprints"]
    assert fp["entries"] == 1 and fp["foreign_entries"] == [
        {"model_id": "renamed", "tokenizer_hash": "tok-first-aaaa", "entries": 1},
        {"model_id": "m", "tokenizer_hash": "tok-second-bbbb", "entries": 1},
    ]
