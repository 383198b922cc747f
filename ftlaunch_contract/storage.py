"""Where checkpoint bytes become durable: a POSIX directory or an S3 prefix.

Both offer the one guarantee the checkpoint format needs: ``write(name, data)`` makes the
object appear whole or not at all (POSIX: temporary name, fsync, rename, directory fsync;
S3: a PUT is atomic). Torch-free, so the agent can persist a dead rank's staged shard.

S3 goes through the client of AWS's ``s3torchconnector`` (the ``s3`` extra): the same
Mountpoint CRT client its datasets and checkpoints use, without importing torch. Region
from ``AWS_REGION`` (default us-east-1), endpoint from ``AWS_ENDPOINT_URL`` (then path-style
addressing, as S3-compatible servers want), credentials from the usual AWS chain.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Protocol

PART = 8 << 20  # the S3 client's multipart upload part size


class StorageError(OSError):
    """The storage cannot be reached or refused an operation; the message says which."""


class Storage(Protocol):
    uri: str

    def write(self, name: str, data: memoryview | bytes) -> None: ...
    def read(self, name: str) -> bytes: ...
    def read_range(self, name: str, offset: int, nbytes: int) -> bytes | bytearray: ...
    def exists(self, name: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def remove_prefix(self, prefix: str) -> None: ...


def open_storage(uri: str | os.PathLike[str]) -> Storage:
    """``s3://bucket/prefix`` or a directory path."""
    text = os.fspath(uri)
    if text.startswith("s3://"):
        return S3Storage(text)
    return PosixStorage(text)


class PosixStorage:
    """A directory on local disk, FSx for Lustre, EFS or any POSIX file system."""

    def __init__(self, path: str):
        self.root = Path(path)
        self.uri = str(self.root)

    def write(self, name: str, data: memoryview | bytes) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_range(self, name: str, offset: int, nbytes: int) -> bytearray:
        with open(self.root / name, "rb", buffering=0) as f:
            f.seek(offset)
            data = bytearray(nbytes)
            with memoryview(data) as view:
                got = 0
                while got < nbytes and (n := f.readinto(view[got:])):
                    got += n
            return data if got == nbytes else data[:got]

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def list(self, prefix: str = "") -> list[str]:
        """Names (relative, '/'-separated) of the files under ``prefix`` (a directory)."""
        base = self.root / prefix
        if not base.is_dir():
            return []
        return [str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()]

    def remove_prefix(self, prefix: str) -> None:
        import shutil

        shutil.rmtree(self.root / prefix, ignore_errors=True)


class S3Storage:
    """An S3 (or S3-compatible) prefix, through s3torchconnector's client."""

    def __init__(self, uri: str):
        try:
            from s3torchconnectorclient._mountpoint_s3_client import (
                MountpointS3Client,
                S3Exception,
            )
        except ImportError:
            raise StorageError(f"{uri}: S3 checkpoints need AWS's s3torchconnector; "
                               "pip install 'ftlaunch[s3]'") from None
        self.uri = uri.rstrip("/")
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise StorageError(f"{uri}: no bucket; write s3://BUCKET/PREFIX")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        self._error = S3Exception
        self._client = MountpointS3Client(
            os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1")),
            user_agent_prefix="ftlaunch", endpoint=endpoint, force_path_style=bool(endpoint))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write(self, name: str, data: memoryview | bytes) -> None:
        try:
            stream = self._client.put_object(self.bucket, self._key(name))
            with memoryview(data) as view:  # released even when a traceback outlives us
                for i in range(0, len(view), PART):  # the client takes bytes: a part at a time
                    stream.write(bytes(view[i:i + PART]))
            stream.close()  # the object exists only once the upload completes
        except self._error as e:
            raise StorageError(f"writing s3://{self.bucket}/{self._key(name)}: {e}") from None

    def read(self, name: str) -> bytes:
        try:
            return b"".join(self._client.get_object(self.bucket, self._key(name)))
        except self._error as e:
            raise StorageError(f"reading s3://{self.bucket}/{self._key(name)}: {e}") from None

    def read_range(self, name: str, offset: int, nbytes: int) -> bytes:
        """One ranged GET."""
        if nbytes == 0:
            return b""
        try:
            return b"".join(self._client.get_object(self.bucket, self._key(name), start=offset,
                                                    end=offset + nbytes))
        except self._error as e:
            raise StorageError(f"reading s3://{self.bucket}/{self._key(name)}: {e}") from None

    def exists(self, name: str) -> bool:
        try:
            self._client.head_object(self.bucket, self._key(name))
            return True
        except self._error:
            return False

    def list(self, prefix: str = "") -> list[str]:
        start = self._key(prefix)
        names = []
        try:
            for page in self._client.list_objects(self.bucket, start):
                names += [o.key[len(self.prefix) + 1 if self.prefix else 0:]
                          for o in page.object_info]
        except self._error as e:
            raise StorageError(f"listing s3://{self.bucket}/{start}: {e}") from None
        return names

    def remove_prefix(self, prefix: str) -> None:
        for name in self.list(prefix):
            with contextlib.suppress(self._error):  # retention retries next time
                self._client.delete_object(self.bucket, self._key(name))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
