"""Downloads over a mock transport or a stand-in `hf_hub_download` (never the network), and
`load_dataset` name resolution."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import httpx
import httpx2
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

import rmm.data as data_pkg
from rmm.data import DATASETS, load_dataset
from rmm.errors import DataError

dl = importlib.import_module("rmm.data.download")

Handler = Callable[[httpx.Request], httpx.Response]


def _client(handler: Handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def _serve(content: bytes, calls: list[str] | None = None) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        if calls is not None:
            calls.append(str(request.url))
        return httpx.Response(200, content=content)

    return _client(handler)


def _offline() -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("name resolution failed", request=request)

    return _client(handler)


def _sha(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _patch_source(monkeypatch: pytest.MonkeyPatch, name: str, **changes) -> None:
    sources = dict(dl.SOURCES)
    sources[name] = dataclasses.replace(sources[name], **changes)
    monkeypatch.setattr(dl, "SOURCES", sources)


class FakeHub:
    """Stands in for `huggingface_hub.hf_hub_download`: writes `content` where it would, or raises."""

    def __init__(self, content: bytes = b"[]", error: Exception | None = None) -> None:
        self.content, self.error = content, error
        self.calls: list[tuple[str, str, str | None, str | None]] = []

    def __call__(self, repo_id: str, filename: str, *, repo_type: str | None = None, revision: str | None = None,
                 local_dir: str | Path | None = None, **_: object) -> str:
        self.calls.append((repo_id, filename, repo_type, revision))
        assert local_dir is not None  # never the shared HF cache: the file lands beside its target
        if self.error is not None:
            raise self.error
        path = Path(local_dir) / filename
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)  # the metadata hf_hub_download keeps
        path.write_bytes(self.content)
        return str(path)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    fake = FakeHub()
    monkeypatch.setattr(dl, "hf_hub_download", fake)
    return fake


def _hub_http_error(status: int) -> RemoteEntryNotFoundError:
    request = httpx2.Request("HEAD", "https://huggingface.co/x")
    return RemoteEntryNotFoundError(f"{status} Client Error", response=httpx2.Response(status, request=request))


def _leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.startswith(".download-") or ".part" in p.name]


LOCOMO_BYTES = b'[{"sample_id": "conv-1"}]'


def test_locomo_success_then_verified_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_source(monkeypatch, "locomo", sha256=_sha(LOCOMO_BYTES))
    calls: list[str] = []
    path = dl.download("locomo", tmp_path, client=_serve(LOCOMO_BYTES, calls))
    assert path == tmp_path / "locomo" / "locomo10.json"
    assert path.read_bytes() == LOCOMO_BYTES
    assert calls == ["https://raw.githubusercontent.com/snap-research/LoCoMo/main/data/locomo10.json"]
    assert not _leftovers(tmp_path)
    # present and correct: no request at all
    assert dl.download("locomo", tmp_path, client=_offline()) == path
    # present but altered: refused
    path.write_bytes(b"[]")
    with pytest.raises(DataError, match="does not match"):
        dl.download("locomo", tmp_path, client=_offline())


def test_locomo_published_checksum(tmp_path: Path) -> None:
    assert dl.SOURCES["locomo"].sha256 == (
        "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"
    )
    with pytest.raises(DataError, match="not 79fa87e9") as err:
        dl.download("locomo", tmp_path, client=_serve(b"tampered"))
    assert "nothing was written" in str(err.value)
    assert not (tmp_path / "locomo" / "locomo10.json").exists()
    assert not _leftovers(tmp_path)


def test_network_failure_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"could not reach https://raw\.githubusercontent") as err:
        dl.download("locomo", tmp_path, client=_offline())
    message = str(err.value)
    assert "(offline?)" in message and str(tmp_path / "locomo" / "locomo10.json") in message
    assert not _leftovers(tmp_path)


def test_http_error_status(tmp_path: Path, hub: FakeHub) -> None:
    client = _client(lambda request: httpx.Response(404))
    with pytest.raises(DataError, match="answered HTTP 404"):
        dl.download("locomo", tmp_path, client=client)
    hub.error = _hub_http_error(404)
    with pytest.raises(DataError, match=r"longmemeval_s_cleaned\.json answered HTTP 404"):
        dl.download("longmemeval", tmp_path)
    assert not _leftovers(tmp_path) and not list((tmp_path / "longmemeval").iterdir())


def test_hub_offline_is_a_clear_error(tmp_path: Path, hub: FakeHub) -> None:
    hub.error = LocalEntryNotFoundError("cannot find the requested files in the local cache")
    with pytest.raises(DataError, match=r"could not reach https://huggingface\.co/.*\(offline\?\)") as err:
        dl.download("longmemeval:oracle", tmp_path)
    assert str(tmp_path / "longmemeval" / "longmemeval_oracle.json") in str(err.value)
    assert not _leftovers(tmp_path)


def test_redirects_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_source(monkeypatch, "locomo", sha256=_sha(LOCOMO_BYTES))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "cdn.example":
            return httpx.Response(200, content=LOCOMO_BYTES)
        return httpx.Response(302, headers={"location": "https://cdn.example/file"})

    assert dl.download("locomo", tmp_path, client=_client(handler)).read_bytes() == LOCOMO_BYTES


def test_longmemeval_trust_on_first_use(tmp_path: Path, hub: FakeHub) -> None:
    first = b'[{"question_id": "q1"}]'
    hub.content = first
    path = dl.download("longmemeval", tmp_path, client=_offline())  # the Hub file never uses the client
    assert path == tmp_path / "longmemeval" / "longmemeval_s_cleaned.json"
    assert path.read_bytes() == first
    assert hub.calls == [("xiaowu0162/longmemeval-cleaned", "longmemeval_s_cleaned.json", "dataset", "main")]
    assert dl.SOURCES["longmemeval:s"].url == (
        "https://huggingface.co/datasets/xiaowu0162/longmemeval-cleaned/resolve/main/"
        "longmemeval_s_cleaned.json"
    )
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]  # no staging left
    sidecar = dl.sidecar_path(path)
    assert sidecar.read_text().split() == [_sha(first), path.name]
    # later runs verify against the sidecar without the network
    assert dl.download("longmemeval:s", tmp_path, client=_offline()) == path
    assert len(hub.calls) == 1
    path.write_bytes(b"[]")
    with pytest.raises(DataError, match="does not match"):
        dl.download("longmemeval:s", tmp_path, client=_offline())
    # a fresh download that differs from the recorded checksum is refused, nothing written
    path.unlink()
    hub.content = b'[{"question_id": "other"}]'
    with pytest.raises(DataError, match="checksum recorded in"):
        dl.download("longmemeval:s", tmp_path)
    assert not path.exists() and not _leftovers(tmp_path)


def test_longmemeval_variants_urls(tmp_path: Path, hub: FakeHub) -> None:
    for name, file in [("longmemeval:oracle", "longmemeval_oracle.json"),
                       ("longmemeval:m", "longmemeval_m_cleaned.json")]:
        path = dl.download(name, tmp_path)
        assert path.name == file and hub.calls[-1][:2] == ("xiaowu0162/longmemeval-cleaned", file)
        assert dl.SOURCES[name].url.endswith(f"/resolve/main/{file}")


def test_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no download source"):
        dl.download("squad", tmp_path, client=_offline())


# --- MSC archive ------------------------------------------------------------------------------


def _msc_archive(extra: dict[str, bytes] | None = None) -> tuple[bytes, dict[str, bytes]]:
    files: dict[str, bytes] = {}
    for k in range(1, 5):
        dialog = [{"id": "bot_0", "text": f"hello {k}"}, {"id": "bot_1", "text": f"hi {k}"}]
        row = {"initial_data_id": "valid_0", "dialog": dialog, "followup": f"more {k}?"}
        files[f"msc/msc_personasummary/session_{k}/valid.txt"] = (json.dumps(row) + "\n").encode()
    members = {**files, "msc/msc_dialogue/session_2/valid.txt": b"ignored",
               "../evil.txt": b"nope", **(extra or {})}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue(), files


def _patch_msc(monkeypatch: pytest.MonkeyPatch, archive: bytes, files: dict[str, bytes]) -> None:
    extracted = {name.removeprefix("msc/"): _sha(content) for name, content in files.items()}
    _patch_source(monkeypatch, "msc", sha256=_sha(archive), extracted_sha256=extracted)


def test_msc_archive_extracted_and_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive, files = _msc_archive()
    _patch_msc(monkeypatch, archive, files)
    folder = dl.download("msc", tmp_path, client=_serve(archive))
    assert folder == tmp_path / "msc"
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(files)  # no dialogue files, nothing outside, no archive left behind
    ds = load_dataset("msc", data_dir=tmp_path)
    assert ds.users == ["msc-valid_0"] and len(ds.sessions["msc-valid_0"]) == 4
    assert dl.download("msc", tmp_path, client=_offline()) == folder


def test_msc_archive_checksums(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive, files = _msc_archive()
    with pytest.raises(DataError, match="nothing was extracted"):
        dl.download("msc", tmp_path, client=_serve(archive))  # ParlAI's real checksum
    _patch_msc(monkeypatch, archive, files)
    sources = dict(dl.SOURCES)
    wrong = dict(sources["msc"].extracted_sha256)
    wrong["msc_personasummary/session_3/valid.txt"] = "0" * 64
    sources["msc"] = dataclasses.replace(sources["msc"], extracted_sha256=wrong)
    monkeypatch.setattr(dl, "SOURCES", sources)
    with pytest.raises(DataError, match="session_3"):
        dl.download("msc", tmp_path, client=_serve(archive))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_msc_not_an_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_source(monkeypatch, "msc", sha256=_sha(b"garbage"))
    with pytest.raises(DataError, match="not a readable tar archive"):
        dl.download("msc", tmp_path, client=_serve(b"garbage"))


# --- load_dataset -----------------------------------------------------------------------------


def test_registry_names() -> None:
    assert {"locomo", "longmemeval:s", "longmemeval:oracle", "longmemeval:m", "msc"} <= set(DATASETS)
    assert DATASETS["locomo"].relative_path == "locomo/locomo10.json"
    assert DATASETS["longmemeval:s"].relative_path == "longmemeval/longmemeval_s_cleaned.json"


@pytest.mark.parametrize(
    ("name", "expected"),
    [("locomo", "locomo/locomo10.json"),
     ("longmemeval", "longmemeval/longmemeval_s_cleaned.json"),
     ("longmemeval:oracle", "longmemeval/longmemeval_oracle.json"),
     ("longmemeval:m", "longmemeval/longmemeval_m_cleaned.json")],
)
def test_missing_dataset_message(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(DataError) as err:
        load_dataset(name, data_dir=tmp_path)
    message = str(err.value)
    assert str(tmp_path / expected) in message
    assert f"rmm data download {DATASETS[data_pkg.ALIASES.get(name, name)].download_name}" in message


def test_missing_msc_message(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_dataset("msc", data_dir=tmp_path)
    message = str(err.value)
    assert str(tmp_path / "msc" / "msc_personasummary" / "session_1" / "valid.txt") in message
    assert "msc_v0.1" in message and "rmm data download msc" in message


def test_data_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RMM_DATA_DIR", str(tmp_path / "env"))
    with pytest.raises(DataError, match="env"):
        load_dataset("locomo")


def test_download_flag_calls_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []

    def fake_download(name: str, data_dir: object) -> Path:
        calls.append((name, data_dir))
        target = tmp_path / "longmemeval" / "longmemeval_s_cleaned.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("[]")
        return target

    monkeypatch.setattr(data_pkg, "download_dataset", fake_download)
    ds = load_dataset("longmemeval", data_dir=tmp_path, download=True)
    assert calls == [("longmemeval:s", tmp_path)] and ds.questions == []
    load_dataset("longmemeval", data_dir=tmp_path, download=True)
    assert len(calls) == 1  # present now: not fetched again


def test_explicit_path_and_unknown(tmp_path: Path) -> None:
    path = tmp_path / "custom.json"
    path.write_text("[]")
    assert load_dataset(f"longmemeval:{path}").questions == []
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(f"locomo:{tmp_path / 'nope.json'}")
    with pytest.raises(DataError, match="unknown dataset 'squad'"):
        load_dataset("squad", data_dir=tmp_path)


def test_load_real_locomo_by_name(data_root: Path) -> None:
    ds = load_dataset("locomo", data_dir=data_root)
    assert ds.name == "locomo" and len(ds.questions) == 1974  # without its 12 repeated questions by default
    assert len(load_dataset("locomo", data_dir=data_root, dedup=False).questions) == 1986


def test_real_hub_client_in_offline_mode_gives_the_offline_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `hf_hub_download`, with offline mode forced on: it refuses before any request."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"could not reach .*longmemeval_m_cleaned\.json \(offline\?\)"):
        dl.download("longmemeval:m", tmp_path)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
