"""The sizes of a benchmark run: the KV geometry of the caches (``Shape``) and
each section's counts and token lengths (``Config``). The full run uses a real
model's geometry at sizes where the costs show; the quick run is the same code
at tiny sizes, CI's check that every section still runs."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """The KV geometry of one model: per layer one K and one V of (1, heads, T, head_dim) bf16."""

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run."""

    mode: str
    shape: Shape  # single-entry figures and the agent workload
    prefix_tokens: int  # fresh entry; the shared prefix of the next turn
    new_tokens: int  # tokens the next turn adds
    partial_tokens: int  # prefix restored by the partial restore
    reps: int
    agent_sessions: int
    agent_turns: int
    agent_system_tokens: int
    agent_turn_tokens: tuple[int, int]  # new tokens per turn, uniform in [lo, hi]
    index_sizes: tuple[int, int]  # entries at which find/open are measured
    index_shape: Shape  # the tiny caches of the index benchmark
    index_tokens: tuple[int, int]  # tokens per index entry, uniform in [lo, hi]
    find_queries: int
    size_tokens: tuple[int, ...]  # entry sizes of the per-size store/restore table
    large_shape: Shape  # the large-entry run (child process)
    large_tokens: tuple[int, int]  # (reference entry, large entry) tokens of large_shape
    remote_tokens: int  # the entry restored from a bucket (moto's server on loopback)
    remote_nodes: int  # nodes sharing a bucket in the agent upload comparison
    remote_entries: int  # entries in the bucket a fresh node opens against
    first_pairs: int = 9  # fresh processes each, alternating, for the first restore against mlx-lm's first load
    block_tokens: int = 256


FULL = Config(
    mode="full",
    shape=Shape(layers=16, kv_heads=8, head_dim=64),  # Llama-3.2-1B's KV geometry
    prefix_tokens=8192,
    new_tokens=512,
    partial_tokens=3000,
    reps=5,
    agent_sessions=32,
    agent_turns=4,
    agent_system_tokens=4096,
    agent_turn_tokens=(64, 256),
    index_sizes=(1_000, 10_000),
    index_shape=Shape(layers=1, kv_heads=1, head_dim=8),
    index_tokens=(48, 160),
    find_queries=2_000,
    size_tokens=(1024, 4096, 8192, 32768),
    large_shape=Shape(layers=32, kv_heads=8, head_dim=128),  # 128 KiB per token
    large_tokens=(2048, 16384),  # 256 MiB and 2 GiB
    remote_tokens=4096,
    remote_nodes=3,
    remote_entries=1_000,
)

QUICK = replace(  # the CI smoke run: the full run with tiny sizes
    FULL,
    mode="quick",
    shape=Shape(layers=4, kv_heads=2, head_dim=64),
    prefix_tokens=1024, new_tokens=256, partial_tokens=300,
    reps=1,
    agent_sessions=3, agent_turns=2, agent_system_tokens=512,
    index_sizes=(20, 60), find_queries=100,
    size_tokens=(256, 1024),
    large_shape=Shape(layers=2, kv_heads=2, head_dim=64), large_tokens=(256, 2048),
    remote_tokens=256, remote_entries=10, first_pairs=2,
)
