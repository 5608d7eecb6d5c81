"""S3 calls of the remote tier: one obstore ``S3Store`` driven by one event
loop thread, so hundreds of requests can be in flight without a thread each.

Provides ``RemoteClient`` with coroutine methods (``head``, ``get``, ``put``,
``delete``, ``list_objects``) that classify every outcome (found, missing,
failed) and time every request into counters, ``submit`` (run one on the
loop from any thread), ``probe`` (the start-up check that turns bad
credentials or a missing bucket into a ``ConfigError``), and
``parse_remote_url`` / ``read_credentials_file``.

Retries are obstore's: bounded (``remote_max_retries``), exponential
backoff with jitter from ``remote_retry_backoff_s``, on 5xx (503 SlowDown
included), dropped connections and timeouts of idempotent requests, all
within ``remote_request_timeout_s``. Credentials come from the standard
``AWS_*`` environment variables or from ``remote_credentials_file``
(the AWS shared-credentials format), never from a command line. TLS
endpoints are verified against the system's roots; plain HTTP is used only
when the endpoint says ``http://``.

Threads: the ``tierstore-remote-io`` loop thread (started through
``tierstore.workers.Workers``) runs every request; callers on any thread
wait on the futures ``submit`` returns, each under its own deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import configparser
import datetime as dt
import logging
import secrets
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

from tierstore.config.remote import RemoteConfig
from tierstore.counters import Counters
from tierstore.errors import ConfigError
from tierstore.workers import Workers

log = logging.getLogger(__name__)
T = TypeVar("T")

REQUEST_COUNTERS = (
    "remote_requests",
    "remote_request_us_total",  # mean latency = us_total / requests
    "remote_request_us_max",
    "remote_request_errors",
    "remote_requests_denied",
)


class ClientClosed(RuntimeError):
    """A request was submitted after ``close`` (the sidecar is shutting down)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    path: str
    size: int
    last_modified_s: float


def parse_remote_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix)."""
    parsed = urlparse(url)
    bucket = parsed.netloc
    if parsed.scheme != "s3" or not bucket:
        raise ConfigError(f"remote_url must look like s3://bucket/prefix, got {url!r}")
    if not 3 <= len(bucket) <= 63 or not all(c.isalnum() or c in "-." for c in bucket):
        raise ConfigError(
            f"remote_url: bucket {bucket!r} is not a valid S3 bucket name "
            "(3-63 characters: lowercase letters, digits, '-' and '.')"
        )
    return bucket, parsed.path.strip("/")


def read_credentials_file(path: str, profile: str) -> dict[str, str]:
    """access_key_id / secret_access_key (/ token) of ``profile`` in an AWS
    shared-credentials file."""
    parser = configparser.ConfigParser()
    try:
        with open(path) as f:
            parser.read_file(f)
    except (OSError, configparser.Error) as e:
        raise ConfigError(f"cannot read remote_credentials_file {path}: {e}") from e
    if not parser.has_section(profile):
        raise ConfigError(
            f"remote_credentials_file {path} has no [{profile}] section "
            f"(sections: {parser.sections()})"
        )
    section = parser[profile]
    try:
        out = {
            "access_key_id": section["aws_access_key_id"],
            "secret_access_key": section["aws_secret_access_key"],
        }
    except KeyError as e:
        raise ConfigError(f"remote_credentials_file {path} [{profile}] lacks {e.args[0]}") from e
    if section.get("aws_session_token"):
        out["token"] = section["aws_session_token"]
    return out


class RemoteClient:
    """The S3 bucket under ``remote_url``; thread-safe. See the module docstring."""

    def __init__(self, cfg: RemoteConfig, counters: Counters, workers: Workers) -> None:
        from obstore.store import S3Store  # the sidecar's remote tier only

        self.cfg = cfg
        self.bucket, self.prefix = parse_remote_url(cfg.remote_url)
        self.counters = counters
        kwargs: dict[str, Any] = {}
        if cfg.remote_endpoint:
            if not cfg.remote_endpoint.startswith(("http://", "https://")):
                raise ConfigError(
                    f"remote_endpoint must start with https:// (or http://), "
                    f"got {cfg.remote_endpoint!r}"
                )
            kwargs["endpoint"] = cfg.remote_endpoint
        if cfg.remote_region:
            kwargs["region"] = cfg.remote_region
        if cfg.remote_credentials_file:
            kwargs.update(
                read_credentials_file(cfg.remote_credentials_file, cfg.remote_credentials_profile)
            )
        timeout = dt.timedelta(seconds=cfg.remote_request_timeout_s)
        self.store = S3Store(
            self.bucket,
            client_options={
                "allow_http": cfg.remote_endpoint.startswith("http://"),
                "connect_timeout": dt.timedelta(seconds=cfg.remote_connect_timeout_s),
                "timeout": timeout,
                "pool_max_idle_per_host": str(cfg.remote_lookup_concurrency),
            },
            retry_config={
                "max_retries": cfg.remote_max_retries,
                "retry_timeout": timeout,
                "backoff": {
                    "init_backoff": dt.timedelta(seconds=cfg.remote_retry_backoff_s),
                    "max_backoff": dt.timedelta(seconds=max(1.0, cfg.remote_retry_backoff_s)),
                    "base": 2,
                },
            },
            **kwargs,
        )
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closed = False
        self._thread = workers.start("tierstore-remote-io", self._run_loop)
        self._ready.wait(10)

    # -- the loop -------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()
        self._loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; the caller waits on the future with its own deadline."""
        if self._closed:
            coro.close()
            raise ClientClosed("the remote client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` for up to ``timeout_s`` (then TimeoutError; the request is cancelled)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"remote request took more than {timeout_s:.3g} s") from None

    def close(self) -> None:
        """Cancel the requests still running (their callers see them fail) and stop the loop."""
        if self._closed:
            return
        self._closed = True
        done = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
        try:
            done.result(10)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            log.warning("remote requests did not end within 10 s of close")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- requests (coroutines, run on the loop) ----------------------------------------

    def _timed(self, t0: float, ok: bool, denied: bool = False) -> None:
        us = int((time.perf_counter() - t0) * 1e6)
        self.counters.add_many(
            {
                "remote_requests": 1,
                "remote_request_us_total": us,
                "remote_request_errors": 0 if ok else 1,
                "remote_requests_denied": 1 if denied else 0,
            }
        )
        if us > self.counters.remote_request_us_max:
            self.counters.set("remote_request_us_max", us)

    async def head(self, path: str) -> bool | None:
        """True: the object exists; False: it does not; None: the request failed."""
        import obstore
        from obstore.exceptions import PermissionDeniedError

        t0 = time.perf_counter()
        try:
            await obstore.head_async(self.store, path)
        except FileNotFoundError:  # obstore's NotFoundError is one
            self._timed(t0, True)
            return False
        except PermissionDeniedError as e:
            self._failed(t0, "HEAD", path, e, denied=True)
            return None
        except Exception as e:  # obstore's errors: network, 5xx after retries, timeouts
            self._failed(t0, "HEAD", path, e)
            return None
        self._timed(t0, True)
        return True

    async def get(self, path: str) -> memoryview | bool | None:
        """The object's bytes; False if it does not exist; None if the request failed."""
        import obstore
        from obstore.exceptions import PermissionDeniedError

        t0 = time.perf_counter()
        try:
            result = await obstore.get_async(self.store, path)
            data = await result.bytes_async()
        except FileNotFoundError:  # obstore's NotFoundError is one
            self._timed(t0, True)
            return False
        except PermissionDeniedError as e:
            self._failed(t0, "GET", path, e, denied=True)
            return None
        except Exception as e:
            self._failed(t0, "GET", path, e)
            return None
        self._timed(t0, True)
        return memoryview(data)

    async def put(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        import obstore
        from obstore.exceptions import PermissionDeniedError

        t0 = time.perf_counter()
        try:
            await obstore.put_async(self.store, path, memoryview(data))
        except PermissionDeniedError as e:
            self._failed(t0, "PUT", path, e, denied=True)
            return False
        except Exception as e:
            self._failed(t0, "PUT", path, e)
            return False
        self._timed(t0, True)
        return True

    async def delete(self, paths: list[str]) -> bool:
        import obstore

        t0 = time.perf_counter()
        try:
            await obstore.delete_async(self.store, paths)
        except FileNotFoundError:  # already gone: what a delete wants
            pass
        except Exception as e:
            self._failed(t0, "DELETE", paths[0] if paths else "", e)
            return False
        self._timed(t0, True)
        return True

    async def list_objects(self, under: str, max_objects: int) -> list[ObjectInfo] | None:
        """Up to ``max_objects`` objects under ``under``; None if listing failed."""
        import obstore

        t0 = time.perf_counter()
        out: list[ObjectInfo] = []
        try:
            stream = obstore.list(self.store, prefix=under, chunk_size=1000)
            async for batch in stream:
                for meta in batch:
                    out.append(
                        ObjectInfo(
                            meta["path"], int(meta["size"]), meta["last_modified"].timestamp()
                        )
                    )
                if len(out) >= max_objects:
                    break
        except Exception as e:
            self._failed(t0, "LIST", under, e)
            return None
        self._timed(t0, True)
        return out[:max_objects]

    def _failed(
        self, t0: float, op: str, path: str, e: BaseException, denied: bool = False
    ) -> None:
        self._timed(t0, False, denied)
        log.debug("remote %s %s failed: %s", op, path, str(e).split("\n", 1)[0])

    # -- start-up check -----------------------------------------------------------------

    def probe(self, timeout_s: float) -> str:
        """Write, read and delete a small object under the prefix. Returns ""
        when all worked, else why not (the store is unreachable or slow).
        Raises ConfigError when the answer says the configuration is wrong
        (credentials refused, bucket missing)."""
        import obstore
        from obstore.exceptions import PermissionDeniedError

        path = f"{self.prefix}/_probe/{secrets.token_hex(8)}".lstrip("/")
        where = f"s3://{self.bucket}/{self.prefix} at {self.cfg.remote_endpoint or 'AWS'}"

        async def steps() -> None:
            stream = obstore.list(self.store, prefix=self.prefix or None, chunk_size=1)
            async for _ in stream:
                break
            await obstore.put_async(self.store, path, b"tierstore probe")
            got = await obstore.get_async(self.store, path)
            if bytes(await got.bytes_async()) != b"tierstore probe":
                raise ConfigError(f"remote store {where} returned other bytes than were written")
            await obstore.delete_async(self.store, path)

        try:
            self.call(steps(), timeout_s)
        except PermissionDeniedError as e:
            raise ConfigError(
                f"remote store {where} refused the credentials (check AWS_ACCESS_KEY_ID / "
                f"AWS_SECRET_ACCESS_KEY or remote_credentials_file, and the bucket policy): "
                f"{_first_line(e)}"
            ) from None
        except FileNotFoundError as e:  # obstore's NotFoundError is one
            raise ConfigError(
                f"remote store {where}: bucket {self.bucket!r} does not exist: {_first_line(e)}"
            ) from None
        except ConfigError:
            raise
        except TimeoutError:
            return f"remote store {where} did not answer within {timeout_s:.3g} s"
        except Exception as e:
            text = str(e)
            if "NoSuchBucket" in text:
                raise ConfigError(
                    f"remote store {where}: bucket {self.bucket!r} does not exist"
                ) from None
            if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch")):
                raise ConfigError(f"remote store {where} refused the credentials") from None
            return f"remote store {where} is not reachable: {_first_line(e)}"
        return ""


def _first_line(e: BaseException) -> str:
    return str(e).split("\n", 1)[0][:300]
