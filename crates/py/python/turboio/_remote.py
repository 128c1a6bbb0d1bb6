"""Remote paths: `sfcs://` (the SFCS backend) and object-store URLs (`s3://`, `gs://`, `az://`,
`abfs[s]://`, `http(s)://`), and the `storage_options=` every API takes for the latter."""

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


def storage(path, storage_options):
    """The object-storage backend configured by `storage_options` for `path` (`None` when there
    are none, or for a path that is not an object-store URL: the environment and the scheme
    decide). One backend per distinct set of options, so connections are reused across calls.

    `storage_options` is a dict of object_store's keys (`endpoint`, `region`, `access_key_id`,
    `secret_access_key`, `session_token`, `allow_http`, `timeout`, ...) and turboio's own
    (`concurrency`, `part_size`, `max_bandwidth`, `max_retries`, `retry_timeout`); a bad key or
    value raises `ValueError` naming it. Its repr never shows a secret."""
    if not storage_options or not is_object_url(path):
        return None
    if not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of option names to values, not {type(storage_options).__name__}")
    items = tuple(sorted((str(k), _text(v)) for k, v in storage_options.items()))
    backend = _storages.get(items)
    if backend is None:
        backend = _storages[items] = _turboio.ObjectStorage(dict(items))
    return backend
