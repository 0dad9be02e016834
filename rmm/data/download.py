"""Fetch the public benchmark files into the data directory (`rmm data download NAME`).

Every file is downloaded to a temporary place beside its target, hashed, and renamed into place
only when complete and verified, so an interrupted or corrupted download never leaves a file the
loaders would read. Files on the Hugging Face Hub (LongMemEval, `xiaowu0162/longmemeval-cleaned`)
come through `huggingface_hub.hf_hub_download` (auth, redirects, resumable transfers, offline
mode); the others (LoCoMo on GitHub, the ParlAI MSC archive) are streamed with httpx.

Checksums: LoCoMo's and the ParlAI MSC archive's SHA-256 are known and enforced. LongMemEval's
Hugging Face files publish none (and were re-cleaned upstream in 2025), so the first download
records the SHA-256 of what arrived in a sidecar `{file}.sha256` (trust on first use); later
`download` calls verify the file against it and a new download that differs from it is refused
until the sidecar is deleted. Loading does not re-hash (LongMemEval-M is 2.7 GB).

Nothing here is called at import time or by the tests with a real network: pass `client` (an
`httpx.Client`, e.g. over `httpx.MockTransport`) to control the plain-URL transport; the tests
replace `hf_hub_download` for the Hub files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from huggingface_hub import hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
)

from rmm.errors import DataError
from rmm.paths import data_dir as resolve_data_dir

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
LONGMEMEVAL_REPO = "xiaowu0162/longmemeval-cleaned"
MSC_ARCHIVE_URL = "http://parl.ai/downloads/msc/msc_v0.1.tar.gz"
_MSC_MEMBER = re.compile(r"(?:^|/)msc_personasummary/session_([1-4])/(train|valid|test)\.txt$")


@dataclass(frozen=True)
class HubFile:
    """One file of a Hugging Face Hub repository."""

    repo_id: str
    filename: str
    repo_type: str = "dataset"
    revision: str = "main"

    @property
    def url(self) -> str:
        return hf_hub_url(self.repo_id, self.filename, repo_type=self.repo_type, revision=self.revision)


@dataclass(frozen=True)
class Source:
    """Where a dataset comes from and where it goes under the data directory."""

    name: str
    url: str  # what messages name; for Hub files, the file's resolve URL
    relative_path: str  # a file, or for archives the folder the loader reads
    sha256: str | None = None  # None: trust on first use (sidecar)
    archive: bool = False
    # For archives: sha256 of extracted files we know, relative to `relative_path`.
    extracted_sha256: dict[str, str] = field(default_factory=dict)
    hub: HubFile | None = None  # set: downloaded with huggingface_hub instead of from `url`


def _longmemeval(variant: str, filename: str) -> Source:
    hub = HubFile(LONGMEMEVAL_REPO, filename)
    return Source(name=f"longmemeval:{variant}", url=hub.url, relative_path=f"longmemeval/{filename}", hub=hub)


SOURCES: dict[str, Source] = {
    "locomo": Source(
        name="locomo",
        url="https://raw.githubusercontent.com/snap-research/LoCoMo/main/data/locomo10.json",
        relative_path="locomo/locomo10.json",
        sha256="79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4",
    ),
    "longmemeval:s": _longmemeval("s", "longmemeval_s_cleaned.json"),
    "longmemeval:oracle": _longmemeval("oracle", "longmemeval_oracle.json"),
    "longmemeval:m": _longmemeval("m", "longmemeval_m_cleaned.json"),
    "msc": Source(
        name="msc",
        url=MSC_ARCHIVE_URL,
        relative_path="msc",
        # ParlAI's own checksum for the archive (parlai/tasks/msc/build.py).
        sha256="e640e37cf4317cd09fc02a4cd57ef130a185f23635f4003b0cee341ffcb45e60",
        archive=True,
        extracted_sha256={
            "msc_personasummary/session_1/valid.txt":
                "b2367fa1d25995c35cd4b86d686eafadeb7c596406a635f04038d78040917d29",
            "msc_personasummary/session_2/valid.txt":
                "33e44ed61007e82960eaf90772c29a319e5084c8a15789e2a0527453cfe06617",
            "msc_personasummary/session_3/valid.txt":
                "4483b0f355882b85e23fcf53bc89ee873e6d7ac3d6a0236d1ab7e964fb8556a3",
            "msc_personasummary/session_4/valid.txt":
                "57b2afd44982b4c877d6776b4b5f4c5bac93cdfa1396d9294add20cef7da400b",
        },
    ),
}
ALIASES: dict[str, str] = {"longmemeval": "longmemeval:s"}


def resolve_source(name: str) -> Source:
    key = ALIASES.get(name, name)
    if key not in SOURCES:
        known = ", ".join(sorted([*SOURCES, *ALIASES]))
        raise DataError(f"no download source for dataset {name!r}; known: {known}")
    return SOURCES[key]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _read_sidecar(target: Path) -> str | None:
    side = sidecar_path(target)
    if not side.is_file():
        return None
    text = side.read_text(encoding="utf-8").split()
    if not text or not re.fullmatch(r"[0-9a-f]{64}", text[0]):
        raise DataError(f"{side}: not a sha256 sidecar (delete it to re-record the checksum)")
    return text[0]


def _write_sidecar(target: Path, digest: str) -> None:
    side = sidecar_path(target)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{digest}  {target.name}\n", encoding="utf-8")
    os.replace(tmp, side)


def _offline_error(source: Source, target: Path, exc: Exception) -> DataError:
    return DataError(
        f"could not reach {source.url} (offline?): {exc} — download it on a machine with "
        f"internet and put it at {target}"
    )


def _fetch_from_hub(hub: HubFile, source: Source, folder: Path, target: Path) -> tuple[Path, str]:
    """Download a Hub file into a staging folder in `folder`; return (temp path beside it, sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        try:
            downloaded = Path(hf_hub_download(hub.repo_id, hub.filename, repo_type=hub.repo_type,
                                              revision=hub.revision, local_dir=staging))
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:  # no connection, or HF_HUB_OFFLINE=1
            raise _offline_error(source, target, exc) from exc
        except HfHubHTTPError as exc:
            raise DataError(f"{source.url} answered HTTP {exc.response.status_code}; download it by hand "
                            f"and put it at {target}") from exc
        fd, tmp_name = tempfile.mkstemp(prefix=".download-", suffix=".part", dir=folder)
        os.close(fd)
        os.replace(downloaded, tmp_name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    tmp = Path(tmp_name)
    logger.info("downloaded %s (%d bytes)", source.url, tmp.stat().st_size)
    return tmp, sha256_file(tmp)


def _fetch(source: Source, client: httpx.Client, folder: Path, target: Path) -> tuple[Path, str]:
    """Stream `source.url` into a temporary file in `folder`; return (temp path, sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".download-", suffix=".part", dir=folder)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as out, client.stream("GET", source.url, follow_redirects=True) as response:
            if response.status_code != 200:
                raise DataError(
                    f"{source.url} answered HTTP {response.status_code}; download it by hand "
                    f"and put it at {target}"
                )
            for chunk in response.iter_bytes(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
    except httpx.HTTPError as exc:
        tmp.unlink(missing_ok=True)
        raise _offline_error(source, target, exc) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info("downloaded %s (%d bytes)", source.url, size)
    return tmp, digest.hexdigest()


def _verify_existing_file(source: Source, target: Path) -> None:
    expected = source.sha256 or _read_sidecar(target)
    actual = sha256_file(target)
    if expected is None:
        _write_sidecar(target, actual)
        logger.info("%s: recorded sha256 %s in %s", target, actual, sidecar_path(target))
    elif actual != expected:
        raise DataError(
            f"{target}: sha256 {actual} does not match the expected {expected}; the file is "
            f"corrupt or a different version — delete it (and {sidecar_path(target).name} if "
            f"present) and download again"
        )


def _download_file(source: Source, target: Path, client: httpx.Client | None) -> Path:
    recorded = None if source.sha256 else _read_sidecar(target)
    if source.hub is not None:
        tmp, actual = _fetch_from_hub(source.hub, source, target.parent, target)
    elif client is not None:
        tmp, actual = _fetch(source, client, target.parent, target)
    else:
        raise ValueError(f"{source.url}: a plain-URL download needs an httpx client")
    expected = source.sha256 or recorded
    if expected is not None and actual != expected:
        tmp.unlink(missing_ok=True)
        what = (
            "the published checksum"
            if source.sha256
            else f"the checksum recorded in {sidecar_path(target)}"
        )
        raise DataError(
            f"{source.url}: downloaded file has sha256 {actual}, not {expected} ({what}); "
            f"nothing was written to {target}"
        )
    os.replace(tmp, target)
    if source.sha256 is None:
        _write_sidecar(target, actual)
        logger.info("%s: no published checksum; recorded sha256 %s in %s",
                    target, actual, sidecar_path(target))
    return target


def _msc_complete(source: Source, folder: Path) -> bool:
    return all((folder / rel).is_file() for rel in source.extracted_sha256)


def _verify_extracted(source: Source, folder: Path) -> None:
    for rel, expected in source.extracted_sha256.items():
        path = folder / rel
        actual = sha256_file(path)
        if actual != expected:
            raise DataError(f"{path}: sha256 {actual} does not match the expected {expected}")


def _download_archive(source: Source, folder: Path, client: httpx.Client) -> Path:
    tmp, actual = _fetch(source, client, folder.parent, folder)
    try:
        if source.sha256 is not None and actual != source.sha256:
            raise DataError(
                f"{source.url}: downloaded archive has sha256 {actual}, not {source.sha256}; "
                f"nothing was extracted to {folder}"
            )
        staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=folder.parent))
        try:
            found = 0
            try:
                with tarfile.open(tmp, "r:*") as archive:
                    for member in archive:
                        match = _MSC_MEMBER.search(member.name)
                        if not match or not member.isfile():
                            continue
                        # Our own path from the matched parts: no traversal from member names.
                        dest = staging / "msc_personasummary" / f"session_{match.group(1)}" / (
                            f"{match.group(2)}.txt"
                        )
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        reader = archive.extractfile(member)
                        if reader is None:
                            continue
                        with reader, dest.open("wb") as out:
                            shutil.copyfileobj(reader, out, _CHUNK)
                        found += 1
            except (tarfile.TarError, OSError, EOFError) as exc:
                raise DataError(f"{source.url}: not a readable tar archive ({exc})") from exc
            if not _msc_complete(source, staging):
                raise DataError(
                    f"{source.url}: archive lacks msc_personasummary/session_{{1..4}}/valid.txt"
                )
            _verify_extracted(source, staging)
            for path in sorted(staging.rglob("*.txt")):
                dest = folder / path.relative_to(staging)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)
            logger.info("extracted %d MSC persona-summary files into %s", found, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        tmp.unlink(missing_ok=True)
    return folder


def download(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    client: httpx.Client | None = None,
    timeout: float = 60.0,
) -> Path:
    """Make dataset `name` present under the data directory; return the path loaders read.

    An existing file is verified (published checksum, or the sidecar recorded at its first
    download) instead of fetched again. `client` and `timeout` apply to plain-URL sources; Hub
    files follow huggingface_hub's own settings (`HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_HUB_DOWNLOAD_TIMEOUT`).
    """
    source = resolve_source(name)
    root = resolve_data_dir(data_dir)
    target = root / source.relative_path
    if source.archive:
        if _msc_complete(source, target):
            _verify_extracted(source, target)
            return target
    elif target.is_file():
        _verify_existing_file(source, target)
        return target

    if source.hub is not None:
        return _download_file(source, target, None)
    own_client = client is None
    http = client or httpx.Client(timeout=timeout, follow_redirects=True)
    try:
        if source.archive:
            return _download_archive(source, target, http)
        target.parent.mkdir(parents=True, exist_ok=True)
        return _download_file(source, target, http)
    finally:
        if own_client:
            http.close()
