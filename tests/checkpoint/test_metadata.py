"""A checkpoint's .metadata is data: read with an allowlist, checked, never run.

Crafted files are refused before anything in them runs (a marker file the payload would
create stays absent); damaged ones raise a SpecError naming the file, whatever byte the
damage hits; checkpoints written by plain DCP keep loading.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

import spmd
import spmd.checkpoint as ck
from spmd import Layout, Mesh, P, Sharded, SpecError
from spmd.checkpoint._metadata import CorruptCheckpointError, read_metadata
from spmd.checkpoint._reader import ShardReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

X = torch.arange(15.0).view(5, 3)


def _saved(path) -> str:
    mesh = Mesh((2,), ("sp",))
    return ck.save({"u": Sharded.from_global(X, mesh, P("sp")), "w": torch.ones(2),
                    "step": 3}, path, mesh)


def _tmpl():
    return {"u": torch.empty(5, 3), "w": torch.empty(2), "step": 0}


class _Shell:
    """Pickles as a call of ``os.system(command)``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_metadata_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    version = _saved(tmp_path / "ck")
    marker = tmp_path / "PWNED"
    with open(os.path.join(version, ".metadata"), "wb") as f:
        pickle.dump(_Shell(f"touch {marker}"), f)
    with pytest.raises(SpecError, match=r"v000001/\.metadata: refused to load the global "
                                        r"posix\.system.*nothing in it was run"):
        ck.load(_tmpl(), tmp_path / "ck")
    assert not marker.exists()


def test_a_pickle_cannot_set_attributes_on_an_allowed_class(tmp_path):
    version = _saved(tmp_path)
    # GLOBAL Metadata; BUILD (None, {"poisoned": 1}): would setattr on the class itself
    crafted = (b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93"
               b"N}\x8c\x08poisoned\x94K\x01s\x86b.")
    with open(os.path.join(version, ".metadata"), "wb") as f:
        f.write(crafted)
    with pytest.raises(SpecError, match="refused to load the BUILD of a type"):
        ck.load(_tmpl(), tmp_path)
    assert not hasattr(Metadata, "poisoned")


def _rewrite(version: str, change) -> None:
    """Change the real metadata (unpickled here, where the test trusts it) and write it
    back."""
    path = os.path.join(version, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    change(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def test_a_data_file_outside_the_version_is_refused(tmp_path):
    version = _saved(tmp_path / "ck")
    shutil.copy(os.path.join(version, "__0_0.distcp"), tmp_path / "x.distcp")

    def escape(md):
        for info in md.storage_data.values():
            info.relative_path = "../../x.distcp"
    _rewrite(version, escape)
    with pytest.raises(SpecError, match=r"names the file '\.\./\.\./x\.distcp', which resolves "
                                        r"to .*x\.distcp', outside the checkpoint directory"):
        ck.load(_tmpl(), tmp_path / "ck")


def test_a_data_file_that_links_out_is_refused(tmp_path):
    version = _saved(tmp_path / "ck")
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(os.path.join(version, "__0_0.distcp"), outside)
    os.symlink(outside, os.path.join(version, "__0_0.distcp"))
    with pytest.raises(SpecError, match=r"names the file '__0_0\.distcp', which resolves to "
                                        r".*elsewhere\.distcp', outside"):
        ck.load(_tmpl(), tmp_path / "ck")


def test_a_metadata_file_that_links_out_is_refused(tmp_path):
    version = _saved(tmp_path / "ck")
    shutil.move(os.path.join(version, ".metadata"), tmp_path / "md")
    os.symlink(tmp_path / "md", os.path.join(version, ".metadata"))
    with pytest.raises(SpecError, match=r"names the file '\.metadata', which resolves to .*md', "
                                        r"outside"):
        ck.load(_tmpl(), tmp_path / "ck")


@pytest.mark.parametrize("damage, says", [
    (lambda raw: b"", r"\.metadata: empty \(0 bytes\)"),
    (lambda raw: raw[:len(raw) // 2], r"\.metadata: cannot be read as DCP metadata \(it "
                                      r"ends before its last record\); the file \(\d+ bytes\) "
                                      r"is truncated or damaged"),
    (lambda raw: raw[:len(raw) - 1], r"\.metadata: cannot be read as DCP metadata \(.+\); "
                                     r"the file \(\d+ bytes\) is truncated or damaged"),
    (lambda raw: raw + b"junk", r"\.metadata: 4 bytes follow the end of the metadata"),
    (lambda raw: pickle.dumps({"a": 1}), r"\.metadata: holds a dict, not DCP's Metadata"),
])
def test_damaged_metadata_names_the_file_and_the_damage(tmp_path, damage, says):
    version = _saved(tmp_path)
    path = os.path.join(version, ".metadata")
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(damage(raw))
    with pytest.raises(CorruptCheckpointError, match=says):
        ck.load(_tmpl(), tmp_path)


def test_chunks_that_do_not_tile_the_tensor_are_refused(tmp_path):
    version = _saved(tmp_path)

    def gap(md):  # the second chunk of u moved one row down: row 3 is in no chunk
        chunk = md.state_dict_metadata["u"].chunks[1]
        chunk.offsets = torch.Size([chunk.offsets[0] + 1, 0])
        chunk.sizes = torch.Size([chunk.sizes[0] - 1, 3])
    _rewrite(version, gap)
    with pytest.raises(CorruptCheckpointError, match=r"the chunks of 'u' do not tile its size "
                                                     r"\[5, 3\]"):
        ck.load(_tmpl(), tmp_path)


def test_a_chunk_larger_than_its_stored_item_is_refused(tmp_path):
    version = _saved(tmp_path)

    def grow(md):  # w claims 10**9 elements: a load would allocate 4 GB for it
        m = md.state_dict_metadata["w"]
        m.size = m.chunks[0].sizes = torch.Size([10**9])
    _rewrite(version, grow)
    with pytest.raises(CorruptCheckpointError, match=r"the item 'w' \(chunk at \[0\]\) is "
                                                     r"\d+ bytes long but its values take "
                                                     r"4000000000"):
        ck.load({"w": ck.AS_SAVED}, tmp_path)


def _load_damaged(mesh, path):
    try:
        ck.load({"u": Layout((5, 3), P("sp"), mesh)}, path, mesh)
    except SpecError as e:
        return type(e).__name__, str(e)
    return None


def test_damage_raises_on_every_rank_thread_as_what_it_is(tmp_path):
    version = _saved(tmp_path)
    with open(os.path.join(version, ".metadata"), "r+b") as f:
        f.truncate(100)
    got = spmd.launch(_load_damaged, (2,), ("sp",), args=(str(tmp_path),))
    assert all(g and g[0] == "CorruptCheckpointError" and ".metadata: cannot be read" in g[1]
               for g in got), got


def test_a_truncated_data_file_names_it_before_reading(tmp_path):
    version = _saved(tmp_path)
    path = os.path.join(version, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: truncated: the item "
                                                     r"'\w+' lies at bytes \[\d+, \d+\) "
                                                     r"but the file has \d+ bytes"):
        ck.load(_tmpl(), tmp_path)


# -- any damaged byte: a clear error or the right values, nothing else ------------------

@pytest.fixture(scope="module")
def flip_ck(tmp_path_factory):
    """One checkpoint for every example; each example damages and restores .metadata."""
    root = str(tmp_path_factory.mktemp("flip"))
    version = _saved(root)
    with open(os.path.join(version, ".metadata"), "rb") as f:
        return root, version, f.read()


@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1,
                      max_size=3))
def test_any_damaged_byte_of_the_metadata_gives_a_clear_error_or_the_right_values(flip_ck,
                                                                                 flips):
    root, version, clean = flip_ck
    raw = bytearray(clean)
    for at, bits in flips:
        raw[at % len(raw)] ^= bits
    marker = os.path.join(root, "PWNED")
    try:
        with open(os.path.join(version, ".metadata"), "wb") as f:
            f.write(raw)
        got = ck.load(_tmpl(), root)
    except SpecError as e:  # CorruptCheckpointError is one
        assert str(e)
    else:  # the damage hit something the load does not depend on
        assert torch.equal(got["u"], X) and torch.equal(got["w"], torch.ones(2))
        assert got["step"] == 3
    finally:
        with open(os.path.join(version, ".metadata"), "wb") as f:
            f.write(clean)
    assert not os.path.exists(marker)


# -- checkpoints written by plain DCP -----------------------------------------------------

def test_a_checkpoint_written_by_plain_dcp_still_loads(tmp_path):
    x = torch.randn(6, 4, dtype=torch.float64)
    h = torch.arange(5).to(torch.bfloat16)
    state = {"model": {"w": x, "h": h}, "step": 7, "i": torch.arange(3)}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    md = read_metadata(str(tmp_path))  # the allowlist admits everything DCP wrote
    assert set(md.state_dict_metadata) == {"model.w", "model.h", "step", "i"}
    mesh = Mesh((3,), ("sp",))
    with ck.read_stats() as stats:
        got = ck.load({"model": {"w": Layout((6, 4), P("sp"), mesh), "h": torch.empty(5,
                       dtype=torch.bfloat16)}, "i": torch.empty(3, dtype=torch.int64)},
                      tmp_path, mesh)
    assert all(torch.equal(got["model"]["w"].shards[r], x[2 * r:2 * r + 2]) for r in range(3))
    assert torch.equal(got["model"]["h"], h) and torch.equal(got["i"], torch.arange(3))
    assert stats.unverified_bytes == stats.payload_bytes > 0  # DCP records no checksums
    # DCP's own planner through ShardReader: the Python value too
    back = {"model": {"w": torch.empty(6, 4, dtype=torch.float64), "h": torch.empty(5,
            dtype=torch.bfloat16)}, "step": 0, "i": torch.empty(3, dtype=torch.int64)}
    dcp.load(back, storage_reader=ShardReader(tmp_path), no_dist=True)
    assert back["step"] == 7 and torch.equal(back["model"]["w"], x)


def test_metadata_read_here_equals_dcps_own_reading(tmp_path):
    _saved(tmp_path)
    version = ck.latest(tmp_path)
    mine = read_metadata(version)
    theirs = dcp.FileSystemReader(version).read_metadata()
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.storage_data == theirs.storage_data
    buf = io.BytesIO()
    pickle.dump(mine, buf)  # still plain DCP metadata, checksums included
    assert buf.getvalue()
