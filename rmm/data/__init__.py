"""Benchmark datasets in one in-memory form (`rmm.types.Dataset`), found by name.

Names (`DATASETS`): `locomo`, `longmemeval` (= `longmemeval:s`), `longmemeval:oracle`,
`longmemeval:s`, `longmemeval:m`, `msc` (valid split; `msc:test`, `msc:train` for the others).
`NAME:PATH` loads that dataset from an explicit file (or MSC folder) instead of the data
directory, e.g. `longmemeval:/data/longmemeval_s.json` for the original, uncleaned release.
`jsonl:PATH` reads rmm's own format (`rmm.data.jsonl`, docs/dataset-format.md), a file or a folder.

LoCoMo loads without its 12 repeated questions (`dedup=True`, MemR³ App. C.3: 1,974 questions)
unless `dedup=False` (1,986): every command reads the same question set by default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rmm.data.download import SOURCES
from rmm.data.download import download as download_dataset
from rmm.data.locomo import LOCOMO_CATEGORIES, load_locomo
from rmm.data.longmemeval import load_longmemeval
from rmm.data.msc import MSC_CATEGORIES, load_msc
from rmm.errors import DataError
from rmm.paths import data_dir as resolve_data_dir
from rmm.types import Dataset

MSC_HOWTO = (
    "it is the `msc_personasummary` part of ParlAI's msc_v0.1 archive "
    "(http://parl.ai/downloads/msc/msc_v0.1.tar.gz): run `rmm data download msc`, or extract "
    "the archive yourself so that msc_personasummary/session_1..4/valid.txt lie in that folder"
)


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: where it lives under the data directory and how to read it."""

    name: str
    relative_path: str
    loader: Callable[..., Dataset]  # (path) → Dataset; also takes dedup= where `dedups`
    download_name: str
    marker: str = ""  # for folders: the file whose presence means "the dataset is here"
    dedups: bool = False  # its loader takes `dedup` (drops repeated questions)

    def path(self, data_dir: str | os.PathLike[str] | None = None) -> Path:
        return resolve_data_dir(data_dir) / self.relative_path

    def present(self, path: Path) -> bool:
        return (path / self.marker).is_file() if self.marker else path.is_file()


def _msc_spec(split: str) -> DatasetSpec:
    name = "msc" if split == "valid" else f"msc:{split}"
    return DatasetSpec(
        name=name,
        relative_path=SOURCES["msc"].relative_path,
        loader=partial(load_msc, split=split),
        download_name="msc",
        marker=f"msc_personasummary/session_1/{split}.txt",
    )


DATASETS: dict[str, DatasetSpec] = {
    "locomo": DatasetSpec("locomo", SOURCES["locomo"].relative_path, load_locomo, "locomo", dedups=True),
    **{
        name: DatasetSpec(name, SOURCES[name].relative_path, load_longmemeval, name)
        for name in ("longmemeval:s", "longmemeval:oracle", "longmemeval:m")
    },
    "msc": _msc_spec("valid"),
    "msc:test": _msc_spec("test"),
    "msc:train": _msc_spec("train"),
}
ALIASES: dict[str, str] = {"longmemeval": "longmemeval:s", "msc:valid": "msc"}


def _missing_message(spec: DatasetSpec, path: Path) -> str:
    where = path / spec.marker if spec.marker else path
    message = f"dataset {spec.name!r} not found: looked for {where}"
    if spec.download_name == "msc":
        return f"{message}; {MSC_HOWTO}"
    return (
        f"{message}. Get it with `rmm data download {spec.download_name}` (or put the file "
        f"there; `--data-dir` / $RMM_DATA_DIR choose the data directory)"
    )


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = False,
    *,
    dedup: bool = True,
) -> Dataset:
    """Load a dataset by name from the data directory, downloading it first if asked to; `dedup`
    drops repeated questions where the dataset has them (LoCoMo), so every caller reads one set."""
    key = ALIASES.get(name, name)
    if key in DATASETS:
        spec = DATASETS[key]
        path = spec.path(data_dir)
        if not spec.present(path):
            if not download:
                raise DataError(_missing_message(spec, path))
            download_dataset(spec.download_name, data_dir)
            if not spec.present(path):
                raise DataError(_missing_message(spec, path))
        return _read(spec, path, dedup)

    base, sep, explicit = name.partition(":")
    if base == "jsonl" and sep:  # rmm's own format (docs/dataset-format.md): a file or a folder of them
        from rmm.data.jsonl import load_jsonl

        if not explicit:
            raise DataError("jsonl: needs a path, e.g. jsonl:my_logs.jsonl (a file or a folder of .jsonl files)")
        return load_jsonl(explicit)
    base_key = ALIASES.get(base, base)
    if sep and explicit and base_key in DATASETS:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise DataError(f"dataset {base!r}: {path} does not exist")
        return _read(DATASETS[base_key], path, dedup)
    known = ", ".join(sorted([*DATASETS, *ALIASES]))
    raise DataError(f"unknown dataset {name!r}; known: {known} (or NAME:PATH for a file, jsonl:PATH for rmm's "
                    "own format)")


def _read(spec: DatasetSpec, path: Path, dedup: bool) -> Dataset:
    return spec.loader(path, dedup=dedup) if spec.dedups else spec.loader(path)


__all__ = [
    "DATASETS",
    "DatasetSpec",
    "LOCOMO_CATEGORIES",
    "MSC_CATEGORIES",
    "download_dataset",
    "load_dataset",
    "load_locomo",
    "load_longmemeval",
    "load_msc",
]
