"""A store's ``remote_options``, as given (values may be strings, as from a
command line): split into what names the endpoint, what tunes the bucket
protocol, and how often the tier lists the bucket."""

from __future__ import annotations

from collections.abc import Mapping

from blockkv.pool.s3 import OPTION_ENV

# remote_options keys that tune the bucket protocol rather than name the endpoint (Bucket's arguments)
BUCKET_SETTINGS: dict[str, type] = {"grace": float, "sweep_window": float, "timeout": float,
                                    "connect_timeout": float, "max_retries": int, "fetch_threads": int,
                                    "touch_interval": float}
DEFAULT_SYNC_INTERVAL = 30.0  # seconds between listings while the store is used


def split_options(options: Mapping[str, object] | None) -> tuple[dict[str, str], dict[str, float | int], float]:
    """``remote_options`` as (endpoint and credentials for S3Pool, Bucket settings, sync interval)."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"remote_options must be a mapping, got {type(options).__name__}")
    s3: dict[str, str] = {}
    settings: dict[str, float | int] = {}
    interval = DEFAULT_SYNC_INTERVAL
    for key, value in (options or {}).items():
        if key in OPTION_ENV:
            s3[key] = str(value)
            continue
        kind = BUCKET_SETTINGS.get(key, float if key == "sync_interval" else None)
        if kind is None:
            raise ValueError(f"unknown remote option {key!r}; expected some of "
                             f"{sorted([*OPTION_ENV, *BUCKET_SETTINGS, 'sync_interval'])}")
        try:
            parsed = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"remote option {key!r} must be a number, got {value!r}") from None
        if key == "sync_interval":
            if not parsed > 0:
                raise ValueError(f"remote option 'sync_interval' must be positive, got {value!r}")
            interval = float(parsed)
        else:
            settings[key] = parsed
    return s3, settings, interval
