"""rmm.config: one YAML + key=value mechanism for every command; mistakes name the key and its source."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field

from rmm.config import load_config, parse_overrides
from rmm.errors import ConfigError, RmmError


@dataclass
class Learner:
    lr: float = 1e-3
    tau: float | None = None


@dataclass
class Run:
    name: str = "run"
    epochs: int = 1
    devices: int | str = "auto"
    mode: Literal["fast", "exact"] = "fast"
    ks: list[int] = field(default_factory=lambda: [5])
    learner: Learner = field(default_factory=Learner)

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_file_then_overrides_with_nested_keys_and_typed_values(tmp_path: Path) -> None:
    path = write(tmp_path, "name: base\nepochs: 3\nlearner:\n  lr: 2e-5\n")  # YAML 1.1 reads 2e-5 as a string
    run = load_config(Run, path, ["learner.tau=0.5", "ks=[1, 10]", "--devices=2", "name=123"])
    assert run == Run(name="123", epochs=3, devices=2, ks=[1, 10], learner=Learner(lr=2e-5, tau=0.5))
    assert isinstance(run.learner, Learner) and run.learner.lr == 2e-5
    assert load_config(Run, path, ["epochs=7"]).epochs == 7  # the override wins over the file
    assert load_config(Run, None, {"learner.lr": 0.1}).learner.lr == 0.1  # typed flags as a mapping
    assert load_config(Run) == Run()
    assert load_config(Run, write(tmp_path, "")) == Run()  # an empty file is the defaults


def test_unknown_keys_name_the_key_its_source_and_the_closest_valid_one(tmp_path: Path) -> None:
    path = write(tmp_path, "epoch: 3\n")
    with pytest.raises(ConfigError, match=rf"unknown setting\(s\) \['epoch'\] in {path} \(did you mean epochs\?\)"):
        load_config(Run, path)
    with pytest.raises(ConfigError, match=r"\['learner.lrr'\] in the overrides \(did you mean learner.lr\?\)"):
        load_config(Run, None, ["learner.lrr=1"])
    with pytest.raises(ConfigError, match="cannot set learner.lr.x: lr is not a section"):
        load_config(Run, None, ["learner.lr=1", "learner.lr.x=2"])


@pytest.mark.parametrize("override, message", [
    ("epochs=three", "epochs must be an integer, got 'three' (in the overrides)"),
    ("epochs=1.5", "epochs must be an integer, got 1.5"),
    ("mode=slow", "mode must be one of 'fast' or 'exact', got 'slow'"),
    ("ks=[1, x]", "ks[1] must be an integer, got 'x'"),
    ("learner.lr=abc", "learner.lr must be a number, got 'abc'"),
    ("learner=3", "learner must be a mapping, got 3"),
    ("devices=[1]", "devices must be an integer or a string, got [1]"),
    ("epochs=0", "epochs must be >= 1, got 0 (from the overrides)"),  # the schema's own check
    ("epochs", "override 'epochs' is not of the form key=value"),
    ("ks=[1", "override 'ks=[1': cannot parse the value"),
])
def test_bad_values_are_one_line_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(Run, None, [override])
    assert message in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value, RmmError)


def test_type_errors_in_the_file_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "epochs: many\n")
    with pytest.raises(ConfigError, match=rf"epochs must be an integer, got 'many' \(in {path}\)"):
        load_config(Run, path, ["name=x"])


def test_unreadable_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read run config .*missing.yaml: it does not exist"):
        load_config(Run, tmp_path / "missing.yaml", label="run config")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(Run, write(tmp_path, "ks: [1, 2\n"))
    with pytest.raises(ConfigError, match="must be a mapping at the top level, got list"):
        load_config(Run, write(tmp_path, "- 1\n"))


def test_parse_overrides_reads_values_as_yaml() -> None:
    assert parse_overrides(["a=1", "b=true", "c=[x, y]", "d=", "max-steps=5", "e=a=b"]) == {
        "a": 1, "b": True, "c": ["x", "y"], "d": None, "max_steps": 5, "e": "a=b"}


@dataclass
class Bounded:
    workers: Annotated[int, Field(ge=1)] = 1
    wait_s: Annotated[float, Field(gt=0, le=2.0)] = 1.0
    limit: Annotated[int, Field(ge=0, lt=10)] | None = None


@pytest.mark.parametrize("override, message", [
    ("workers=0", "workers must be >= 1, got 0 (in the overrides)"),
    ("wait_s=0", "wait_s must be > 0, got 0"),
    ("wait_s=2.5", "wait_s must be <= 2, got 2.5"),
    ("limit=10", "limit must be < 10, got 10"),
    ("limit=-1", "limit must be >= 0, got -1"),
])
def test_field_bounds_read_as_comparisons(override: str, message: str) -> None:
    """A range is a pydantic field constraint; its error says the comparison, not pydantic's sentence."""
    with pytest.raises(ConfigError) as error:
        load_config(Bounded, None, [override])
    assert message in str(error.value)
    assert load_config(Bounded, None, ["limit=null", "wait_s=2"]) == Bounded(wait_s=2.0)
