"""LATEST names a version of its own directory, or the load refuses it, naming it."""
from __future__ import annotations

import os
import re

import pytest
import torch

import spmd.checkpoint as ck
from spmd import Mesh, SpecError
from spmd.checkpoint._metadata import CorruptCheckpointError

ONE = Mesh((1,), ("sp",))


@pytest.fixture
def two(tmp_path):
    """Two checkpoints side by side: ``ck`` (w = zeros) and ``other`` (w = ones)."""
    ck.save({"w": torch.zeros(3)}, tmp_path / "ck", ONE)
    ck.save({"w": torch.ones(3)}, tmp_path / "other", ONE)
    return tmp_path


def _point(root, text: bytes) -> None:
    with open(os.path.join(root, "LATEST"), "wb") as f:
        f.write(text)


@pytest.mark.parametrize("name", ["../other/v000001", "{tmp}/other/v000001", "v000001/..",
                                  "v1", "hello"])
def test_latest_naming_anything_but_a_version_is_refused(two, name):
    name = name.format(tmp=two)
    _point(two / "ck", name.encode() + b"\n")
    with pytest.raises(SpecError, match=rf"LATEST' names '{re.escape(name)}', not a version "
                                        rf"of .*ck' \(expected 'v' and 6 or more digits.*"
                                        rf"refusing"):
        ck.load({"w": torch.empty(3)}, two / "ck")
    with pytest.raises(SpecError, match="refusing to follow it"):
        ck.latest(two / "ck")


def test_latest_naming_a_link_out_of_the_directory_is_refused(two):
    os.symlink(two / "other" / "v000001", two / "ck" / "v000009")
    _point(two / "ck", b"v000009\n")
    with pytest.raises(SpecError, match=r"LATEST' names 'v000009', a link to '.*other/v000001', "
                                        r"outside '.*ck'; refusing to follow it"):
        ck.load({"w": torch.empty(3)}, two / "ck")


def test_a_link_to_a_version_of_the_same_directory_is_followed(two):
    os.symlink(two / "ck" / "v000001", two / "ck" / "v000002")
    _point(two / "ck", b"v000002\n")
    assert not ck.load({"w": torch.empty(3)}, two / "ck")["w"].any()


@pytest.mark.parametrize("text, says", [
    (b"\xff\xfev\x00", r"LATEST' is not text \(it starts b'\\xff\\xfev\\x00'\)"),
    (b"", r"LATEST' is empty"),
    (b" \n", r"LATEST' is empty"),
])
def test_a_damaged_latest_names_the_file(two, text, says):
    _point(two / "ck", text)
    with pytest.raises(CorruptCheckpointError, match=says + r"; expected 'v' and 6 or more "
                                                            r"digits.*the file is damaged"):
        ck.load({"w": torch.empty(3)}, two / "ck")


def test_latest_naming_a_version_without_metadata_is_refused(two):
    os.makedirs(two / "ck" / "v000005")
    _point(two / "ck", b"v000005\n")
    with pytest.raises(SpecError, match=r"names version '.*v000005', which has no \.metadata"):
        ck.load({"w": torch.empty(3)}, two / "ck")
