"""The CLI after a real ``blockkv serve --per-key-cache`` run: each API key's
entries are a namespace of the model's identity (their blocks named with the
namespace's key), and ``ls``, ``stats``, ``check``, ``evict``, ``rm`` and
``export`` see them as such; every command's "on disk" is one figure, the
apparent size of the fingerprint directory's files (what ``du -sb`` counts).

One server run (module-scoped): a system prompt warmed first without
per-key caches (the directory then holds both kinds of entry), then the
server with two keys driven by the ``openai`` client, stopped so its spills
are on disk. The tests work on copies of the root when they change it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from test_cli import run, run_json

from blockkv.human import format_size
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.fleet_processes import Process
from blockkv.wire.auth import namespace_of

BOUND_S = 300.0  # safety bound on a subprocess or a request (not a timing assertion)


@dataclass(frozen=True)
class PerKeyRun:
    root: Path
    model: Path
    namespaces: tuple[str, str]  # of key a, key b
    log: str  # the server's


def du_bytes(path: Path) -> int:
    """What ``du -sb`` counts: the apparent size of every file under ``path``."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def per_key_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PerKeyRun]:
    tmp = tmp_path_factory.mktemp("per-key")
    model = build_model_dir(tmp / "model", "llama")
    root = tmp / "kv"
    system = tmp / "system.txt"
    system.write_text(sample_text(300, seed=41))  # over one block (256 tokens): a block stored
    warmed = run("warm", root, system, "--model", model)  # a shared entry, stored without per-key caches
    assert warmed.returncode == 0, warmed.stderr
    a, b = "sk-tenant-a-" + "1" * 16, "sk-tenant-b-" + "2" * 16
    keys = tmp / "keys"
    keys.write_text(f"{a}\n{b}\n")
    node = Process(["serve", "--model", str(model), "--cache-dir", str(root), "--per-key-cache",
                    "--api-key-file", str(keys), "--log-level", "INFO"], tmp / "serve.log")
    try:
        node.wait_ready()
        for key, seeds in ((a, (1, 2)), (b, (3,))):
            client = openai.OpenAI(base_url=node.url + "/v1", api_key=key, max_retries=0, timeout=BOUND_S)
            for seed in seeds:
                messages = [{"role": "system", "content": sample_text(300, seed=40 + seed)},
                            {"role": "user", "content": sample_text(10, seed=seed)}]
                client.chat.completions.create(model="default_model", messages=messages, max_tokens=4,
                                               temperature=0.0)
    finally:
        assert node.stopped_cleanly(), node.log.read_text()
    spaces = tuple(namespace_of(hashlib.sha256(k.encode()).digest()) for k in (a, b))
    yield PerKeyRun(root, model, spaces, node.log.read_text())  # type: ignore[arg-type]


def copy_of(run: PerKeyRun, tmp_path: Path) -> Path:
    root = tmp_path / "kv"
    shutil.copytree(run.root, root)
    return root


def test_ls_and_stats_list_count_and_size_the_per_key_entries(per_key_run: PerKeyRun) -> None:
    a, b = per_key_run.namespaces
    listed = run_json("ls", per_key_run.root)["entries"]
    by_ns = {ns: [e for e in listed if e["ns"] == ns] for ns in ("", a, b)}
    assert len(by_ns[a]) >= 1 and len(by_ns[b]) >= 1 and len(by_ns[""]) == 1  # the warmed one too
    assert len(listed) == sum(map(len, by_ns.values()))  # nothing else
    (fp,) = run_json("stats", per_key_run.root)["fingerprints"]
    assert fp["entries"] == len(listed)
    assert {n["ns"]: n["entries"] for n in fp["namespaces"]} == {ns: len(v) for ns, v in by_ns.items()}
    assert fp["foreign_entries"] == []
    directory = Path(fp["dir"])
    du = du_bytes(directory)
    assert du / 2 <= fp["disk_bytes"] <= du * 2  # what du says, within 2x (defined as exactly it: docs/cli.md)
    text = run("stats", per_key_run.root).stdout
    assert "another tokenizer" not in text and "never served" not in text, text
    shown = run("ls", per_key_run.root, "-n", a).stdout
    assert all(e["id"] in shown for e in by_ns[a]) and not any(e["id"] in shown for e in by_ns[b])


def test_one_on_disk_figure_whichever_command_prints_it(per_key_run: PerKeyRun, tmp_path: Path) -> None:
    root = copy_of(per_key_run, tmp_path)
    (fp,) = run_json("stats", root)["fingerprints"]
    figure = fp["disk_bytes"]
    planned = run_json("evict", root, "--all", "--to", "1G", "--dry-run")["fingerprints"][0]
    assert planned["disk_bytes_before"] == figure and planned["entries"] == []
    gc = run_json("gc", root, "--all")["fingerprints"][0]  # nothing unreferenced: nothing goes
    assert gc["blocks_deleted"] == 0 and gc["disk_bytes"] == run_json("stats", root)["fingerprints"][0]["disk_bytes"]
    text = run("evict", root, "--all", "--to", "1G").stdout
    assert f"{format_size(run_json('stats', root)['fingerprints'][0]['disk_bytes'])} on disk is within" in text, text


def test_check_calls_nothing_foreign(per_key_run: PerKeyRun) -> None:
    done = run("check", per_key_run.root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "foreign" not in done.stdout and "config_fingerprint" not in done.stdout, done.stdout
    (fp,) = run_json("check", per_key_run.root)["fingerprints"]
    listed = run_json("ls", per_key_run.root)["entries"]
    assert fp["foreign_owners"] == [] and fp["report"]["entries"] == len(listed)


def test_evict_plans_and_removes_per_key_entries_lru_first(per_key_run: PerKeyRun, tmp_path: Path) -> None:
    root = copy_of(per_key_run, tmp_path)
    listed = run_json("ls", root)["entries"]  # least recently used first
    planned = run_json("evict", root, "--all", "--to", "0", "--dry-run")["fingerprints"][0]
    assert [e["id"] for e in planned["entries"]] == [e["id"] for e in listed]  # --to 0: every entry, LRU first
    assert planned["disk_bytes_before"] >= sum(e["nbytes"] for e in listed) - 0  # not "0 B on disk"
    assert run_json("ls", root)["entries"] == listed  # a dry run changes nothing
    done = run_json("evict", root, "--all", "--to", "0")["fingerprints"][0]
    assert [e["id"] for e in done["entries"]] == [e["id"] for e in listed]
    assert run_json("ls", root)["entries"] == []
    assert run("gc", root, "--all", "--grace", "0").returncode == 0
    assert not list((Path(done["dir"]) / "blobs").rglob("*/*"))  # every block went with gc


def test_rm_removes_one_keys_namespace(per_key_run: PerKeyRun, tmp_path: Path) -> None:
    root = copy_of(per_key_run, tmp_path)
    a, b = per_key_run.namespaces
    (fp,) = run_json("stats", root)["fingerprints"]
    before = {e["id"]: e["ns"] for e in run_json("ls", root)["entries"]}
    gone = run_json("rm", root, "-f", fp["fingerprint"], "-n", a)
    assert sorted(e["id"] for e in gone["entries"]) == sorted(i for i, ns in before.items() if ns == a)
    left = {e["id"]: e["ns"] for e in run_json("ls", root)["entries"]}
    assert left == {i: ns for i, ns in before.items() if ns != a}
    one_of_b = next(i for i, ns in left.items() if ns == b)
    by_id = run("rm", root, "-f", fp["fingerprint"], one_of_b[:10])
    assert by_id.returncode == 0 and one_of_b in by_id.stdout, by_id.stderr
    assert one_of_b not in {e["id"] for e in run_json("ls", root)["entries"]}
    assert run_json("check", root)["clean"] is True


def test_export_finds_and_writes_a_per_key_entry(per_key_run: PerKeyRun, tmp_path: Path) -> None:
    from mlx_lm.models.cache import load_prompt_cache

    listed = run_json("ls", per_key_run.root)["entries"]
    latest = max(listed, key=lambda e: e["last_use"])
    assert latest["ns"] in per_key_run.namespaces  # the server's last request, after the warmed entry
    out = tmp_path / "latest.safetensors"
    done = run_json("export", per_key_run.root, "latest", "-o", out, "--model", per_key_run.model)
    assert done["entry"]["id"] == latest["id"]
    caches, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert len(json.loads(metadata["blockkv_tokens"])) == latest["tokens"] == caches[0].offset
    by_id = run_json("export", per_key_run.root, listed[0]["id"], "-o", tmp_path / "first.safetensors")
    assert by_id["entry"]["id"] == listed[0]["id"]


def test_serve_states_what_it_found_and_warns_of_nothing(per_key_run: PerKeyRun) -> None:
    first = next(line for line in per_key_run.log.splitlines() if "blockkv: disk tier in" in line)
    assert "nothing stored yet" not in first
    found = re.search(r"holding ([0-9.]+ [KMGT]?i?B)", first)
    assert found is not None and found.group(1) != "0 B", first
    assert "another identity" not in per_key_run.log and "config_fingerprint" not in per_key_run.log
