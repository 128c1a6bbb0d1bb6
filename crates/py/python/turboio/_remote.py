"""Remote paths: `sfcs://` (the SFCS backend) and object-store URLs (`s3://`, `gs://`, `az://`,
`abfs[s]://`, `http(s)://`), and the `storage_options=` every API takes for the latter."""

import os as _os

from . import _turboio

OBJECT_SCHEMES = ("s3://", "gs://", "az://", "abfs://", "abfss://", "http://", "https://")

_storages = {}


def is_object_url(path):
    return isinstance(path, str) and path.startswith(OBJECT_SCHEMES)


def is_remote(path):
    """True for a path that does not name a local file (so `os.path` cannot check it)."""
    return isinstance(path, str) and (path.startswith("sfcs://") or is_object_url(path))


def _text(v):
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def shown(path):
    """`path` as error messages show it: a URL without user info or query string."""
    return _turboio._shown(_os.fspath(path))


def storage(path, storage_options, cache_dir=None):
    """The object-storage backend configured by `storage_options` and `cache_dir` for `path`
    (`None` when there are neither, or for a path that is not an object-store URL: the
    environment and the scheme decide). One backend per distinct set of options, so connections
    are reused across calls.

    `cache_dir` (every load API's `cache_dir=`; else `TURBOIO_CACHE_DIR`) is a node-local cache:
    the first load of an object version writes it through to a local file there while loading
    it, later loads read that file; processes loading the same object at once fetch it once.
    `TURBOIO_CACHE_REVALIDATE` (seconds, or 90s, 5m, 1h) trusts the version the store reported
    that long: a cached object then loads with no request to the store. The directory must be
    this user's and writable by nobody else (it is created 0700), unless `TURBOIO_CACHE_SHARED=1`
    shares it between users (entries then served only if their bytes match the SHA-256 recorded
    at publication); another directory is not used (one warning, the load goes to the store).

    `storage_options` is a dict of object_store's keys (`endpoint`, `region`, `access_key_id`,
    `secret_access_key`, `session_token`, `allow_http`, `timeout`, ...) and turboio's own
    (`concurrency`, `part_size`, `max_bandwidth`, `max_retries`, `retry_timeout`); a bad key or
    value raises `ValueError` naming it. Its repr never shows a secret."""
    if not (storage_options or cache_dir is not None) or not is_object_url(path):
        return None
    storage_options = storage_options or {}
    if not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of option names to values, not {type(storage_options).__name__}")
    items = tuple(sorted((str(k), _text(v)) for k, v in storage_options.items()))
    cache = None if cache_dir is None else _os.fspath(cache_dir)
    # Without cache_dir the environment's cache applies: read when the backend is made, so the
    # variables are part of what tells backends apart.
    env = tuple(_os.environ.get(v) for v in ("TURBOIO_CACHE_DIR", "TURBOIO_CACHE_MAX_SIZE", "TURBOIO_CACHE_REVALIDATE", "TURBOIO_CACHE_SHARED"))
    key = (items, cache, env)
    backend = _storages.get(key)
    if backend is None:
        backend = _storages[key] = _turboio.ObjectStorage(dict(items), cache_dir=cache)
    return backend
