"""Every stored item carries crc32 checksums per block; a load verifies what it reads.

Damaged values are found naming the file and the key, on whole and on resharded loads;
``read_stats`` says what a load could not verify (the edges of a partial read whose
blocks would cost too much to read whole; checkpoints without checksums).
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

import spmd.checkpoint as ck
from spmd import Layout, Mesh, P, Sharded
from spmd.checkpoint import _checksums
from spmd.checkpoint._metadata import CorruptCheckpointError, read_metadata
from spmd.checkpoint.entries import TREE_KEY

W = torch.arange(40 * 8, dtype=torch.float32).view(40, 8)


def _flip(version: str, needle: bytes, at: int) -> None:
    """Flip one bit of the byte ``at`` bytes into the first copy of ``needle``."""
    path = os.path.join(version, "__0_0.distcp")
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    start = blob.find(needle)
    assert start >= 0
    blob[start + at] ^= 0x10
    with open(path, "wb") as f:
        f.write(blob)


def test_a_damaged_value_is_found_naming_the_file_and_the_key(tmp_path):
    version = ck.save({"w": W}, tmp_path, Mesh((1,), ("sp",)))
    _flip(version, W.numpy().tobytes(), 4 * 8 * 20 + 5)  # a byte of row 20
    with pytest.raises(CorruptCheckpointError, match=r"v000001/__0_0\.distcp, item 'w' \(chunk "
                                                     r"at \[0, 0\]\): checksum mismatch in "
                                                     r"bytes \[0, 1280\)"):
        ck.load({"w": torch.empty(40, 8)}, tmp_path)


def test_a_resharded_load_verifies_the_part_it_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "BLOCK", 64)  # 2 rows per block: 20 blocks
    version = ck.save({"w": W}, tmp_path, Mesh((1,), ("sp",)))
    mesh = Mesh((2,), ("sp",))
    lay = Layout((40, 8), P("sp"), mesh, sizes={0: [11, 29]})  # row 11 cuts block 5
    with ck.read_stats() as stats:
        got = ck.load({"w": lay}, tmp_path, mesh)["w"]
    assert torch.equal(got.shards[0], W[:11]) and torch.equal(got.shards[1], W[11:])
    assert stats.payload_bytes == 40 * 8 * 4 and stats.unverified_bytes == 0
    # block 5 (rows 10, 11) is read whole once: rank 0 verifies it, and rank 1 (held by
    # this process too) reads its part of a block verified already
    assert stats.check_bytes == 32
    _flip(version, W.numpy().tobytes(), 4 * 8 * 20 + 5)  # row 20: block 10, rank 1's part
    with pytest.raises(CorruptCheckpointError, match=r"item 'w' .*checksum mismatch in bytes "
                                                     r"\[640, 704\)"):
        ck.load({"w": lay}, tmp_path, mesh)


def test_what_a_partial_read_cannot_verify_cheaply_is_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "BLOCK", 16384)  # 4 blocks per 64 KiB row
    x = torch.randn(4, 16384)
    ck.save({"x": x}, tmp_path, Mesh((1,), ("sp",)))
    mesh = Mesh((2,), ("sp",))
    lay = Layout((4, 16384), P(None, "sp"), mesh, sizes={1: [1, 16383]})
    with ck.read_stats() as stats:
        got = ck.load({"x": lay}, tmp_path, mesh)["x"]
    assert torch.equal(got.shards[0], x[:, :1]) and torch.equal(got.shards[1], x[:, 1:])
    # rank 0's column: one 4-byte run per row, in a 16 KiB block that rank 1 reads whole
    # only after it; reading it whole for 4 bytes would cost 4096 times the run
    assert stats.unverified_bytes == 4 * 4
    assert stats.payload_bytes == x.numel() * 4


def test_a_damaged_python_value_is_found(tmp_path):
    version = ck.save({"step": 123456789, "name": "run-a"}, tmp_path, Mesh((1,), ("sp",)))
    _flip(version, b"run-a", 2)
    with pytest.raises(CorruptCheckpointError, match=rf"item '{TREE_KEY}' \(the state's "
                                                     r"structure and Python values\): checksum "
                                                     r"mismatch"):
        ck.load({"step": 0, "name": ""}, tmp_path)


def test_a_checkpoint_without_checksums_still_loads_unverified(tmp_path):
    version = ck.save({"w": W, "step": 3}, tmp_path, Mesh((1,), ("sp",)))
    path = os.path.join(version, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        delattr(info, _checksums.ATTR)  # as plain DCP and older spmd wrote them
    with open(path, "wb") as f:
        pickle.dump(md, f)
    assert all(_checksums.stored(i) is None for i in read_metadata(version).storage_data.values())
    with ck.read_stats() as stats:
        got = ck.load({"w": torch.empty(40, 8), "step": 0}, tmp_path)
    assert torch.equal(got["w"], W) and got["step"] == 3
    assert stats.unverified_bytes > stats.payload_bytes == W.numel() * 4  # + the tree record


def test_damaged_checksum_records_are_found_before_reading(tmp_path):
    version = ck.save({"w": W}, tmp_path, Mesh((1,), ("sp",)))
    path = os.path.join(version, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        block, crcs = _checksums.stored(info)
        setattr(info, _checksums.ATTR, (block, crcs[:-1]))
    with open(path, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CorruptCheckpointError, match=r"the checksum record of '\w+' does not "
                                                     r"fit its bytes"):
        ck.load({"w": torch.empty(40, 8)}, tmp_path)


def test_sharded_values_on_several_ranks_verify_everything(tmp_path):
    mesh = Mesh((2, 2), ("dp", "sp"))
    u = Sharded.from_global(torch.randn(9, 7, dtype=torch.float64), mesh, P("sp", "dp"))
    ck.save({"u": u}, tmp_path, mesh)
    m3 = Mesh((3,), ("sp",))
    with ck.read_stats() as stats:
        got = ck.load({"u": Layout((9, 7), P(None, "sp"), m3)}, tmp_path, m3)["u"]
    want = torch.cat([u.shards[r] for r in (0, 2)], 1)
    want = torch.cat([want, torch.cat([u.shards[r] for r in (1, 3)], 1)], 0)
    assert torch.equal(torch.cat([got.shards[r] for r in range(3)], 1), want)
    assert stats.unverified_bytes == 0


def _gloo_load_damaged(mesh, path):
    lay = Layout((40, 8), P(None, "sp"), mesh)
    try:
        ck.load({"w": lay}, path, mesh)
    except CorruptCheckpointError as e:
        return str(e)
    return None


@pytest.mark.gloo
def test_gloo_a_damaged_value_raises_on_every_rank(gloo2, tmp_path):
    version = ck.save({"w": W}, tmp_path, Mesh((1,), ("sp",)))
    _flip(version, W.numpy().tobytes(), 4 * 8 * 20 + 5)  # column 1 of row 20: rank 0's
    msgs = gloo2.run(_gloo_load_damaged, (2,), ("sp",), args=(str(tmp_path),))
    assert all(m and "__0_0.distcp, item 'w'" in m and "checksum mismatch" in m
               for m in msgs), msgs
