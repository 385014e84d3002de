"""``blockkv rm`` by id and by namespace, and the default root every command
shares with ``blockkv serve`` (``$XDG_CACHE_HOME/blockkv``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model


def blockkv(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blockkv", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def test_rm_by_id_and_by_namespace_in_the_default_root(tmp_path: Path) -> None:
    root = tmp_path / "xdg" / "blockkv"  # where serve keeps its cache with XDG_CACHE_HOME set
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    llama = tiny_model("llama")
    with BlockStore(root, model_id="tiny", config_fingerprint="rm-test", tokenizer_hash="t", max_bytes=1 << 30,
                    block_tokens=64) as store:
        for ns, seed in (("a", 1), ("a", 2), ("b", 3), ("", 4)):
            tokens = random_tokens(130, seed=seed)
            assert store.store(tokens, prefill(llama, tokens)[0], ns=ns)
        ids = {e.ns: e.id for e in store.entries()}
    listed = json.loads(blockkv("ls", "--json", env=env).stdout)  # no ROOT: the default one
    assert listed["root"] == str(root) and len(listed["entries"]) == 4

    gone = blockkv("rm", "-f", "rm-test", "-n", "a", "--json", env=env)  # no ROOT again
    assert gone.returncode == 0, gone.stderr
    assert sorted(e["ns"] for e in json.loads(gone.stdout)["entries"]) == ["a", "a"]
    by_id = blockkv("rm", root, "-f", "rm-test", ids["b"][:8])  # ROOT -f FP ENTRY: ids after the options
    assert by_id.returncode == 0, by_id.stderr
    assert ids["b"] in by_id.stdout and "blockkv gc -f rm-test" in by_id.stdout
    assert "removed 1 entries; " in by_id.stdout and " still on disk in this fingerprint" in by_id.stdout  # not freed
    hint = by_id.stdout.split("'")[1]  # the gc it names works as printed
    assert blockkv(*hint.split()[1:], root, "--grace", "0").returncode == 0
    left = json.loads(blockkv("ls", root, "--json").stdout)["entries"]
    assert [e["id"] for e in left] == [ids[""]]
    assert json.loads(blockkv("check", root, "--json").stdout)["clean"] is True

    for argv, message in ((["rm", root, "-f", "rm-test"], "name entries"), (["rm", root, "nope"], "-f"),
                          (["rm", root, "-f", "rm-test", "feedface"], "no entry 'feedface'"),
                          (["rm", root, "-f", "rm-test", ""], "empty entry id"),  # "$ID" of an unset variable
                          (["rm", root, "-f", "", ids[""]], "empty fingerprint")):
        refused = blockkv(*argv)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert [e["id"] for e in json.loads(blockkv("ls", root, "--json").stdout)["entries"]] == [ids[""]]
    out = tmp_path / "missing" / "x.safetensors"
    export = blockkv("export", root, ids[""], "-f", "rm-test", "-o", out)
    assert export.returncode == 1 and "Traceback" not in export.stderr, export.stderr
    assert export.stderr.strip() == f"blockkv export: cannot write {out}: no directory {out.parent}"
