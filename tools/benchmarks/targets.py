"""The issue-#5 targets, the verdict of a run: each a ratio or bound computed
from the run's figures against a baseline of the same run, and whether it is
met."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cli_start import BASELINE
from .config import Config
from .harness import MIB


@dataclass(frozen=True)
class Target:
    """One issue-#5 target: ``value`` compared with ``bound``."""

    name: str
    value: float
    op: str  # ">=", "<=", "<" or "=="
    bound: float
    unit: str

    @property
    def met(self) -> bool:
        return {
            ">=": self.value >= self.bound,
            "<=": self.value <= self.bound,
            "<": self.value < self.bound,
            "==": self.value == self.bound,
        }[self.op]


def targets(cfg: Config, r: dict[str, Any]) -> list[Target]:
    """The issue's targets, each a ratio or bound computed from this run's figures."""
    w, bk, ml, ag, ix, cs = r["writes"], r["restore"], r["mlx"], r["agent"], r["index"], r["start"]
    bpt, big = cfg.shape.bytes_per_token, cfg.index_sizes[-1]
    block = cfg.block_tokens * bpt
    lg, (ref_tokens, big_tokens) = r["large"], cfg.large_tokens
    return [
        Target(
            "fresh store (fsync'd) speed vs mlx-lm save + fsync",
            w["mlx_save_fsync_fresh_s"] / w["fresh_store_s"],
            ">=",
            1.0,
            "x",
        ),
        Target(
            "next-turn store speed vs mlx-lm save + fsync of the whole cache",
            w["mlx_save_fsync_whole_s"] / w["next_turn_store_s"],
            ">=",
            10.0,
            "x",
        ),
        Target(
            "next-turn bytes written / (new tokens' bytes + 2 blocks + header)",
            w["next_turn_bytes_written"]
            / (cfg.new_tokens * bpt + 2 * block + w["header_bytes"]),
            "<=",
            1.0,
            "x",
        ),
        Target(
            "full restore (verify, warm) vs mlx-lm load + eval, same long-lived process",
            bk["same_process_mlx_load_s"] / bk["full_restore_s"],
            ">=",
            1.0,
            "x",
        ),
        Target(
            "full restore (verify, warm) / the same restore unverified (verify=False), same long-lived process",
            bk["full_restore_s"] / bk["full_restore_noverify_s"],
            "<=",
            1.1,
            "x",
        ),
        Target(
            "full restore (verify, warm, fresh process) speed vs mlx-lm load + eval",
            ml["load_eval_child_s"] / bk["full_restore_child_s"],
            ">=",
            0.5,
            "x",
        ),
        Target(
            "first restore in a fresh process (a restarted server's first hit) vs mlx-lm's first load, medians",
            bk["mlx_first_load_child_s"] / bk["first_restore_child_s"],
            ">=",
            1.0,
            "x",
        ),
        Target(
            f"partial restore of {cfg.partial_tokens} tokens: block files read",
            bk["partial_blocks_read"],
            "==",
            bk["partial_blocks_expected"],
            "blocks",
        ),
        Target(
            "agent footprint vs ideal unique bytes",
            ag["footprint_vs_ideal"],
            "<=",
            1.15,
            "x",
        ),
        Target(
            "agent footprint vs file-per-entry", ag["footprint_vs_fpe"], "<=", 0.2, "x"
        ),
        Target(
            f"find p99 at {big} entries", ix[f"find_{big}"]["p99_ms"], "<", 2.0, "ms"
        ),
        Target(
            f"open at {big} entries, valid index", ix["open_valid_s"], "<", 1.0, "s"
        ),
        Target(
            "open: rebuild time / valid-index time",
            ix["open_rebuild_s"] / ix["open_valid_s"],
            ">=",
            10.0,
            "x",
        ),
        Target(
            f"open at {big} entries after a reboot (index settled) / open with a valid index",
            ix["open_reboot_settled_s"] / ix["open_valid_s"],
            "<=",
            1.25,
            "x",
        ),
        Target(
            "restore peak RSS / (2 x entry bytes + 100 MiB)",
            bk["restore_peak_rss_delta"] / (2 * bk["entry_nbytes"] + 100 * MIB),
            "<=",
            1.0,
            "x",
        ),
        *(
            Target(f"start of `{name}` / `{BASELINE}`", seconds / cs["seconds"][BASELINE], "<=", 0.25, "x")
            for name, seconds in cs["seconds"].items() if "blockkv" in name
        ),
        *(
            Target(f"fresh store vs mlx-lm save + fsync, {z['tokens']} tokens",
                   z["mlx_save_fsync_s"] / z["store_s"], ">=", 1.0, "x")
            for z in r["sizes"].values()
        ),
        *(
            Target(f"cold restore vs sequential read of the same bytes, {z['tokens']} tokens",
                   z["seq_read_cold_s"] / z["restore_cold_s"], ">=", 0.8, "x")
            for z in r["sizes"].values()
        ),
        *(
            Target(f"large entry ({big_tokens} tokens): {step} peak RSS growth / entry bytes",
                   lg[str(big_tokens)][f"{step}_peak_delta"] / lg[str(big_tokens)]["bytes"], "<=", 1.1, "x")
            for step in ("store", "restore")
        ),
        *(
            Target(f"large entry ({big_tokens} tokens): {step} throughput / {ref_tokens}-token entry's",
                   speed(lg[str(big_tokens)], step) / speed(lg[str(ref_tokens)], step), ">=", 0.8, "x")
            for step in ("store", "restore")
        ),
        *(
            [Target("restore from the bucket, cold local pool (moto on loopback) vs warm local restore",
                    r["remote"]["restore"]["local_warm_s"] / r["remote"]["restore"]["bucket_cold_s"], ">=", 0.5, "x"),
             Target("restore from the bucket vs plain concurrent GETs of the same blocks (time of the GETs / ours)",
                    r["remote"]["restore"]["raw_get_s"] / r["remote"]["restore"]["bucket_cold_s"], ">=", 0.8, "x")]
            if r.get("remote") else []
        ),
    ]


def speed(run: dict[str, float], step: str) -> float:
    """Bytes per second of one step of a large-entry child run."""
    return run["bytes"] / run[f"{step}_s"]
