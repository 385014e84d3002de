"""A store's ``remote_options``, as given (values may be strings, as from a
command line): split into what names the endpoint, what tunes the bucket
protocol, how often the tier lists the bucket, and the fleet key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from blockkv.bucket.fleet_key import FleetKey, fleet_key
from blockkv.pool.s3 import OPTION_ENV

# remote_options keys that tune the bucket protocol rather than name the endpoint (Bucket's arguments)
BUCKET_SETTINGS: dict[str, type] = {"grace": float, "sweep_window": float, "timeout": float,
                                    "connect_timeout": float, "max_retries": int, "fetch_threads": int,
                                    "touch_interval": float}
DEFAULT_SYNC_INTERVAL = 30.0  # seconds between listings while the store is used


@dataclass(frozen=True)
class RemoteOptions:
    s3: dict[str, str]  # endpoint and credentials, for S3Pool
    settings: dict[str, float | int]  # Bucket's protocol settings
    sync_interval: float
    key: FleetKey | None  # the fleet key (``key``, else BLOCKKV_FLEET_KEY), or None


def split_options(options: Mapping[str, object] | None) -> RemoteOptions:
    """``remote_options`` split by what each key is for; a wrong one is a ValueError/TypeError."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"remote_options must be a mapping, got {type(options).__name__}")
    s3: dict[str, str] = {}
    settings: dict[str, float | int] = {}
    interval = DEFAULT_SYNC_INTERVAL
    secret = None
    for key, value in (options or {}).items():
        if key in OPTION_ENV:
            s3[key] = str(value)
            continue
        if key == "key":
            secret = value
            continue
        kind = BUCKET_SETTINGS.get(key, float if key == "sync_interval" else None)
        if kind is None:
            raise ValueError(f"unknown remote option {key!r}; expected some of "
                             f"{sorted([*OPTION_ENV, *BUCKET_SETTINGS, 'sync_interval', 'key'])}")
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
    return RemoteOptions(s3, settings, interval, fleet_key(secret))


def probe_bucket(url: str, options: Mapping[str, object] | None) -> str | None:
    """Does the bucket of ``url`` exist? FileNotFoundError (one line naming it)
    if the server says it does not; PermissionError if no credentials were
    given and the instance metadata service (obstore's last resort) gave none:
    a mistake to fix, not an outage to ride out; the reason as a line if the
    server could not be asked (an outage: a node starts anyway and retries);
    None if it does."""
    from blockkv.pool.s3 import NoSuchBucketError, S3Pool

    opts = split_options(options)
    timing = {k: v for k, v in opts.settings.items() if k in ("timeout", "connect_timeout", "max_retries")}
    try:
        S3Pool(url, options=opts.s3, **timing).check_bucket()
    except NoSuchBucketError as exc:
        raise FileNotFoundError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - obstore raises many types for one meaning
        reason = str(exc).strip().partition("\n")[0]
        if "/latest/api/token" in reason or "/latest/meta-data/" in reason:  # the metadata service's paths
            raise PermissionError(
                f"no credentials for {url}: none given (--remote-option access_key_id=... and "
                f"secret_access_key=..., or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) and the instance metadata "
                f"service gave none ({reason})") from None
        return f"bucket of {url} not reachable now ({reason})"
    return None
