"""Objects on S3-compatible storage: `s3://bucket/key` locations, paged listings, ranged reads.

The endpoint and credentials come only from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION) or boto's own config files, never from our YAML, so
they never reach run tags, logs or metadata. Every request is counted (`REQUESTS`), so a step can
report its requests per sample.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO

URL_SCHEME = "s3://"
# Ranged reads of a big object (a JSON-lines manifest) are buffered this much per request.
READ_BUFFER = 8 << 20
NO_SUCH_BUCKET = "NoSuchBucket"  # the store's error code for a bucket that does not exist

REQUESTS: Counter[str] = Counter()  # request kind -> requests made by this process


def is_object_url(location: object) -> bool:
    return isinstance(location, ObjectURL) or (isinstance(location, str) and location.startswith(URL_SCHEME))


@dataclass(frozen=True, order=True)
class ObjectURL:
    """An object (or a prefix of objects) in a bucket; keys are normalised POSIX paths without a leading '/'."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> ObjectURL:
        if not url.startswith(URL_SCHEME):
            raise ValueError(f"{url!r} is not an {URL_SCHEME}bucket/key URL")
        bucket, _, key = url[len(URL_SCHEME):].partition("/")
        if not bucket or "\x00" in url:
            raise ValueError(f"{url!r} names no bucket ({URL_SCHEME}bucket/key)")
        normal = posixpath.normpath("/" + key).lstrip("/") if key else ""
        return cls(bucket, "" if normal == "." else normal)

    def __str__(self) -> str:
        return f"{URL_SCHEME}{self.bucket}/{self.key}"

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def parent(self) -> ObjectURL:
        return ObjectURL(self.bucket, posixpath.dirname(self.key))

    def child(self, relative: str) -> ObjectURL | None:
        """The object `relative` names below this prefix, or None when it leads out of it (`..`, absolute)."""
        if relative.startswith("/") or "\x00" in relative:
            return None
        joined = posixpath.normpath(posixpath.join(self.key, relative))
        if joined == ".." or joined.startswith("../"):
            return None
        candidate = ObjectURL(self.bucket, "" if joined == "." else joined)
        return candidate if self.contains(candidate) and candidate != self else None

    def contains(self, other: ObjectURL) -> bool:
        if other.bucket != self.bucket:
            return False
        return not self.key or other.key == self.key or other.key.startswith(self.key + "/")

    def relative(self, other: ObjectURL) -> str:
        """`other`'s key below this prefix (ValueError when it is not below)."""
        if not self.contains(other):
            raise ValueError(f"{other} is not below {self}")
        return other.key[len(self.key):].lstrip("/") if self.key else other.key


@dataclass(frozen=True)
class ObjectInfo:
    url: ObjectURL
    size: int
    etag: str
    mtime_ns: int


_local = threading.local()


def _connect_anew_after_fork() -> None:
    """A forked child opens its own connections: sharing its parent's would mix their requests and answers."""
    global _local
    _local = threading.local()
    _recent_heads.clear()


os.register_at_fork(after_in_child=_connect_anew_after_fork)
# A store that stops answering (frozen, or gone with its connections left open) fails a request after
# at most STORE_ATTEMPTS × (connect + read timeout) and the back-off between. A store slow to answer
# large reads may be given longer through the environment, as the rest of the store's settings are.
STORE_READ_TIMEOUT_ENV_VAR = "VLM_ASSETS_STORE_READ_TIMEOUT_S"
STORE_CONNECT_TIMEOUT_S = 5
STORE_ATTEMPTS = 3


def store_read_timeout_s() -> float:
    """Seconds a request waits for the store to answer: $VLM_ASSETS_STORE_READ_TIMEOUT_S, default 20."""
    value = os.environ.get(STORE_READ_TIMEOUT_ENV_VAR, "").strip()
    if not value:
        return 20.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"${STORE_READ_TIMEOUT_ENV_VAR} must be a positive number of seconds, not {value!r}")
    return seconds


def client() -> Any:
    """This thread's S3 client, configured by the environment alone."""
    if getattr(_local, "client", None) is None:
        import boto3  # imported on first use: a purely local run never pays for it
        from botocore.config import Config

        _local.client = boto3.session.Session().client("s3", config=Config(
            retries={"max_attempts": STORE_ATTEMPTS, "mode": "standard"}, max_pool_connections=32,
            connect_timeout=STORE_CONNECT_TIMEOUT_S, read_timeout=store_read_timeout_s()))
    return _local.client


# The answers of this process's latest HEAD requests: a step that resolves a medium and then
# fingerprints it asks twice within moments, and one request is enough.
_recent_heads: dict[ObjectURL, tuple[float, ObjectInfo | None]] = {}
RECENT_HEADS = 4096


def head(url: ObjectURL, max_age: float = 0.0) -> ObjectInfo | None:
    """The object's size, ETag and modification time, or None when there is no such object.
    `max_age`: seconds an answer this process got before may be old instead of asking again."""
    recent = _recent_heads.get(url)
    if max_age and recent is not None and time.monotonic() - recent[0] <= max_age:
        return recent[1]
    info = _head(url)
    if len(_recent_heads) >= RECENT_HEADS:
        _recent_heads.pop(next(iter(_recent_heads)))
    _recent_heads[url] = (time.monotonic(), info)
    return info


def _head(url: ObjectURL) -> ObjectInfo | None:
    from botocore.exceptions import ClientError

    REQUESTS["head"] += 1
    try:
        with _reaching_store(url, "look it up"):
            reply = client().head_object(Bucket=url.bucket, Key=url.key)
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _refused(url, "look it up", error) from error
    return ObjectInfo(url, reply["ContentLength"], reply["ETag"].strip('"'),
                      int(reply["LastModified"].timestamp() * 1e9))


def list_objects(prefix: ObjectURL) -> Iterator[ObjectInfo]:
    """Every object below `prefix` (a folder: `prefix/…`), in key order, one page (1,000 keys) at a time."""
    from botocore.exceptions import ClientError

    paginator = client().get_paginator("list_objects_v2")
    folder = f"{prefix.key}/" if prefix.key else ""
    pages = iter(paginator.paginate(Bucket=prefix.bucket, Prefix=folder))
    while True:
        try:
            with _reaching_store(prefix, "list it"):
                page = next(pages, None)
        except ClientError as error:
            raise _refused(prefix, "list it", error) from error
        if page is None:
            return
        REQUESTS["list"] += 1
        for item in page.get("Contents", []):
            yield ObjectInfo(ObjectURL(prefix.bucket, item["Key"]), item["Size"], item["ETag"].strip('"'),
                             int(item["LastModified"].timestamp() * 1e9))


def read_range(url: ObjectURL, start: int, size: int, if_match: str = "") -> bytes:
    """`size` bytes at `start`; with `if_match`, of that ETag's version only (OSError once it changed)."""
    if size <= 0:
        return b""
    REQUESTS["get"] += 1
    return _get(url, if_match, Range=f"bytes={start}-{start + size - 1}")


def read_object(url: ObjectURL, if_match: str = "") -> bytes:
    """The whole object; with `if_match`, of that ETag's version only (OSError once it changed)."""
    REQUESTS["get"] += 1
    return _get(url, if_match)


def _get(url: ObjectURL, if_match: str, **request: str) -> bytes:
    what = f"bytes {request['Range'][6:]}" if "Range" in request else "it"
    headers = dict(request, **({"If-Match": f'"{if_match}"'} if if_match else {}))
    reply = _signed_get(url, headers, what)
    if reply.status == 412:
        raise OSError(f"{url} changed after it was catalogued (its ETag is no longer {if_match}): run the catalogue again")
    if reply.status not in (200, 206):
        raise OSError(f"{url}: cannot read {what}: {_refusal(url, reply)}")
    return reply.data


def read_start(url: ObjectURL, size: int) -> tuple[ObjectInfo, bytes] | None:
    """The object's first `size` bytes (all of it when it is no bigger) with its size, ETag and
    modification time, in one ranged GET; None when there is no such object."""
    REQUESTS["get"] += 1
    what = f"bytes 0-{size - 1}"
    reply = _signed_get(url, {"Range": f"bytes=0-{size - 1}"}, what)
    if reply.status == 404 and _error_field(reply, "Code") != NO_SUCH_BUCKET:
        return None
    if reply.status == 416:  # an empty object has no byte 0
        info = head(url)
        return None if info is None else (info, b"")
    if reply.status not in (200, 206):
        raise OSError(f"{url}: cannot read {what}: {_refusal(url, reply)}")
    data = reply.data
    content_range = reply.headers.get("Content-Range")
    total = int(content_range.rpartition("/")[2]) if content_range else len(data)
    modified = parsedate_to_datetime(reply.headers["Last-Modified"])
    return ObjectInfo(url, total, reply.headers["ETag"].strip('"'), int(modified.timestamp() * 1e9)), data


# boto3 spends about 1.1 ms of CPU on a GET (event hooks, user agent, response parsing); the same GET,
# signed by boto3 as a presigned URL and sent through urllib3, about 0.55 ms. Reads of media are most of
# a build's requests and the CPU is shared with the build, so GETs take this way; HEAD, LIST and PUT stay
# with boto3. Presigned URLs sign only the host: Range and If-Match travel as plain headers.
PRESIGNED_SECONDS = 900
_GET_RETRIES = {"total": STORE_ATTEMPTS - 1, "backoff_factor": 0.1, "status_forcelist": (429, 500, 502, 503, 504),
                "allowed_methods": frozenset({"GET"}), "raise_on_status": False}


# The query of a presigned address (SigV4's X-Amz-Signature, SigV2's Signature): a credential for minutes.
_SIGNED_QUERY = re.compile(r"\?[^\s'\")]*Signature=[^\s'\")]*")


class _UnsignedLog(logging.Filter):
    """urllib3 logs each retry with the address it retries, signature and all: logged without it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Signature=" in message:
            record.msg, record.args = _SIGNED_QUERY.sub("?…", message), None
        return True


def _signed_get(url: ObjectURL, headers: dict[str, str], what: str) -> Any:
    import urllib3
    from botocore.exceptions import BotoCoreError

    try:
        address = client().generate_presigned_url(
            "get_object", Params={"Bucket": url.bucket, "Key": url.key}, ExpiresIn=PRESIGNED_SECONDS)
        with _reaching_store(url, f"read {what}"):
            return _http().request("GET", address, headers=headers, retries=urllib3.Retry(**_GET_RETRIES),
                                   timeout=urllib3.Timeout(connect=STORE_CONNECT_TIMEOUT_S, read=store_read_timeout_s()))
    except (BotoCoreError, urllib3.exceptions.HTTPError) as error:
        # urllib3 quotes the address it was given, whose query is a signature valid for minutes: not for logs.
        reason = _SIGNED_QUERY.sub("?…", str(error))
        raise OSError(f"{url}: cannot read {what} (endpoint {client().meta.endpoint_url}): {reason}") from error


def _http() -> Any:
    """This thread's HTTP connections for signed GETs: through the proxy the environment names for the
    endpoint, checked against the CA bundle boto is configured with."""
    if getattr(_local, "http", None) is None:
        import urllib.request

        import botocore.session
        import urllib3

        pool_log = logging.getLogger("urllib3.connectionpool")
        if not any(isinstance(known, _UnsignedLog) for known in pool_log.filters):
            pool_log.addFilter(_UnsignedLog())
        endpoint = urllib3.util.parse_url(client().meta.endpoint_url)
        proxy = urllib.request.getproxies().get(endpoint.scheme)
        options = {"maxsize": 32, "ca_certs": botocore.session.get_session().get_config_variable("ca_bundle")}
        _local.http = (urllib3.ProxyManager(proxy, **options)
                       if proxy and not urllib.request.proxy_bypass(endpoint.host) else urllib3.PoolManager(**options))
    return _local.http


def _error_field(reply: Any, tag: str) -> str:
    found = re.search(f"<{tag}>(.*?)</{tag}>", reply.data[:4096].decode("utf-8", "replace"))
    return found.group(1) if found else ""


def _refusal(url: ObjectURL, reply: Any) -> str:
    """The store's answer to a refused request: its status and, from the error document, code and message."""
    code = _error_field(reply, "Code")
    refusal = " ".join(part for part in (f"HTTP {reply.status}", code, _error_field(reply, "Message")) if part)
    return f"{refusal}: {_missing_bucket_hint(url.bucket)}" if code == NO_SUCH_BUCKET else refusal


def _refused(url: ObjectURL, doing: str, error: Exception) -> OSError:
    """One line for a request the store refused (a botocore or boto3 error): what was asked, of
    which bucket on which endpoint, and why; a missing bucket said so, with how to create it."""
    from botocore.exceptions import ClientError

    cause = error if isinstance(error, ClientError) else error.__context__
    code = cause.response.get("Error", {}).get("Code", "") if isinstance(cause, ClientError) else ""
    if code == NO_SUCH_BUCKET:
        return OSError(f"{url}: cannot {doing}: {_missing_bucket_hint(url.bucket)}")
    return OSError(f"{url}: cannot {doing} (endpoint {client().meta.endpoint_url}): {error}")


@contextlib.contextmanager
def _reaching_store(url: ObjectURL, doing: str) -> Iterator[None]:
    """A request that could not connect to the store (down, a wrong address, the network gone) raises
    one line naming the endpoint and why, instead of the HTTP libraries' chain of errors."""
    try:
        yield
    except Exception as error:
        reason = _connection_failure(error)
        if reason is None:
            raise
        raise OSError(f"store unreachable at {client().meta.endpoint_url}: {reason} ({url}: cannot {doing})") from error


def _connection_failure(error: BaseException) -> str | None:
    """Why no connection could be made (refused, timed out, no such host): the socket's error at the end
    of the chain boto3 or urllib3 raised; None when `error` is no failure to connect."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from urllib3.exceptions import ConnectTimeoutError, MaxRetryError, NewConnectionError

    if not (isinstance(error, BotoConnectionError) or
            isinstance(error, MaxRetryError) and isinstance(error.reason, (ConnectTimeoutError, NewConnectionError))):
        return None
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
    return getattr(error, "strerror", None) or str(error)


def _missing_bucket_hint(bucket: str) -> str:
    return (f"bucket {bucket!r} does not exist on {client().meta.endpoint_url}; create it first "
            f"(e.g. `aws s3 mb s3://{bucket}`)")


# Bigger objects are uploaded in parts; the store shows the object only once every part is in.
MULTIPART_BYTES = 64 << 20


def upload_file(path: Path, url: ObjectURL) -> None:
    """Upload a file whole: a reader sees the old object or the new one, never part of it."""
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig

    REQUESTS["put"] += 1
    try:
        with _reaching_store(url, f"upload {path}"):
            client().upload_file(str(path), url.bucket, url.key,
                                 Config=TransferConfig(multipart_threshold=MULTIPART_BYTES,
                                                       multipart_chunksize=MULTIPART_BYTES))
    except S3UploadFailedError as error:
        raise _refused(url, f"upload {path}", error) from error


def read_object_if_any(url: ObjectURL) -> bytes | None:
    """The object's bytes, or None when there is no such object."""
    from botocore.exceptions import ClientError

    REQUESTS["get"] += 1
    try:
        with _reaching_store(url, "read it"):
            return client().get_object(Bucket=url.bucket, Key=url.key)["Body"].read()
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _refused(url, "read it", error) from error


def create_once(url: ObjectURL, data: bytes) -> bool:
    """Create the object unless one exists (a conditional write, If-None-Match: *); True if this call created it."""
    from botocore.exceptions import ClientError

    REQUESTS["put"] += 1
    try:
        with _reaching_store(url, "create it"):
            client().put_object(Bucket=url.bucket, Key=url.key, Body=data, IfNoneMatch="*")
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            return False
        raise _refused(url, "create it", error) from error
    return True


class _RangedObject(io.RawIOBase):
    """A seekable, read-only view of one object, each read a ranged GET (buffered by open_object)."""

    def __init__(self, url: ObjectURL, size: int) -> None:
        self.url, self.size, self.position = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), self.size - self.position)
        if wanted <= 0:
            return 0
        data = read_range(self.url, self.position, wanted)
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def open_object(url: ObjectURL, size: int | None = None, buffer: int = READ_BUFFER) -> io.BufferedReader:
    """A buffered, seekable binary reader of the object: `readline`, `seek` and `tell` work as on a file."""
    return io.BufferedReader(_RangedObject(url, location_size(url) if size is None else size), buffer_size=buffer)


# -- a source's file, wherever it lies -------------------------------------------------------------
Location = Path | ObjectURL


def location_of(value: str | os.PathLike[str] | ObjectURL) -> Location:
    """A path or URL given by a user (`s3://…` for an object) as a Location."""
    if isinstance(value, ObjectURL):
        return value
    return ObjectURL.parse(value) if isinstance(value, str) and is_object_url(value) else Path(value)


def resolved(location: Location) -> Location:
    """A local path as its real path (symlinks resolved); an object as it is."""
    return location if isinstance(location, ObjectURL) else Path(os.path.realpath(location))


def location_stamp(location: Location) -> str:
    """What a write to the file or object changes: its size, modification and change times (of an
    object, its size and ETag). The change time catches what the others miss: a file restored with
    its old modification time (`cp -p`, `touch -r`) or its permissions changed. FileNotFoundError
    when there is none."""
    if isinstance(location, ObjectURL):
        info = head(location)
        if info is None:
            raise FileNotFoundError(f"{location} does not exist")
        return f"{info.size}:{info.etag}"
    stat = os.stat(location)
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"


def location_size(location: Location) -> int:
    """The file's or object's size in bytes (FileNotFoundError when there is none)."""
    if isinstance(location, ObjectURL):
        info = head(location)
        if info is None:
            raise FileNotFoundError(f"{location} does not exist")
        return info.size
    return os.stat(location).st_size


def exists(location: Location) -> bool:
    """A file or folder; an object, or a prefix with objects below it."""
    if isinstance(location, ObjectURL):
        return head(location) is not None or next(iter(list_objects(location)), None) is not None
    return os.path.exists(location)


def is_file(location: Location) -> bool:
    if isinstance(location, ObjectURL):
        return head(location) is not None
    return os.path.isfile(location)


def open_location(location: Location, buffer: int = READ_BUFFER) -> BinaryIO:
    """A seekable binary reader of the file or object (an object read `buffer` bytes per request)."""
    if isinstance(location, ObjectURL):
        return open_object(location, buffer=buffer)
    return open(resolved(location), "rb")


def read_location(location: Location) -> bytes:
    if isinstance(location, ObjectURL):
        return read_object(location)
    return Path(location).read_bytes()
