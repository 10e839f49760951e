"""Keyed checkpoints: tampering (a re-hashed edit, another coordinator's key) is refused, not only corruption."""
from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from lensemble.errors import IntegrityError
from lensemble.federation.checkpoint import KEY_BYTES, coordinator_key, coordinator_key_path, load_checkpoint, save_checkpoint
from tests.test_checkpoint import RUN, _checkpoint, _flip


def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    newline = data.index(b"\n")
    return json.loads(data[:newline]), data[newline + 1 :]


def _write(path: Path, header: dict, body: bytes) -> None:
    path.write_bytes(json.dumps(header).encode() + b"\n" + body)


def _saved(tmp_path: Path) -> tuple[Path, Path]:
    path, key = tmp_path / "checkpoints" / "fed.ckpt", coordinator_key_path(tmp_path)
    save_checkpoint(path, _checkpoint(tmp_path), key)
    return path, key


def test_key_is_created_once_private_and_random(tmp_path):
    path, key = _saved(tmp_path)
    assert key == tmp_path / "keys" / "coordinator.hmac"
    assert len(key.read_bytes()) == KEY_BYTES and stat.S_IMODE(key.stat().st_mode) == 0o600
    first = key.read_bytes()
    save_checkpoint(path, _checkpoint(tmp_path, round_idx=4), key)
    assert key.read_bytes() == first  # reused, never rotated behind the checkpoint's back
    assert coordinator_key(tmp_path / "other" / "k.hmac") != first
    assert load_checkpoint(path, RUN, key).round_idx == 4


def test_rehashed_tampered_checkpoint_is_refused(tmp_path):
    """An attacker edits the metadata and recomputes the sha256 (and keeps the sizes right)."""
    path, key = _saved(tmp_path)
    header, body = _split(path)
    n_meta = header["meta_bytes"]
    meta = json.loads(body[:n_meta])
    meta["round_idx"] = 7  # skip rounds
    new_meta = json.dumps(meta, sort_keys=True).encode()
    new_body = new_meta + body[n_meta:]
    header.update(sha256=hashlib.sha256(new_body).hexdigest(), meta_bytes=len(new_meta))
    _write(path, header, new_body)
    with pytest.raises(IntegrityError, match=f"checkpoint {path} fails its HMAC check: tampered") as info:
        load_checkpoint(path, RUN, key)
    assert "\n" not in str(info.value)


def test_rehashed_tensor_edit_is_refused(tmp_path):
    path, key = _saved(tmp_path)
    header, body = _split(path)
    body = bytearray(body)
    body[-100] ^= 0x01
    header["sha256"] = hashlib.sha256(bytes(body)).hexdigest()
    _write(path, header, bytes(body))
    with pytest.raises(IntegrityError, match="fails its HMAC check"):
        load_checkpoint(path, RUN, key)


def test_stripped_mac_is_refused(tmp_path):
    path, key = _saved(tmp_path)
    header, body = _split(path)
    del header["hmac_sha256"]
    _write(path, header, body)
    with pytest.raises(IntegrityError, match=f"{path} fails its HMAC check"):
        load_checkpoint(path, RUN, key)


def test_checkpoint_of_another_coordinator_key_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    other = coordinator_key(tmp_path / "elsewhere" / "coordinator.hmac")
    with pytest.raises(IntegrityError, match=f"{path} fails its HMAC check: written under another coordinator key") as info:
        load_checkpoint(path, RUN, tmp_path / "elsewhere" / "coordinator.hmac")
    assert other.hex() not in str(info.value)  # the message names key ids, never key bytes


def test_forged_key_id_still_refused(tmp_path):
    """key_id is a label: copying ours into a foreign checkpoint proves nothing."""
    path, key = _saved(tmp_path)
    forged = tmp_path / "forged.ckpt"
    save_checkpoint(forged, _checkpoint(tmp_path), tmp_path / "attacker.hmac")
    header, body = _split(forged)
    header["key_id"] = _split(path)[0]["key_id"]
    _write(forged, header, body)
    with pytest.raises(IntegrityError, match="fails its HMAC check: tampered"):
        load_checkpoint(forged, RUN, key)


def test_missing_key_with_existing_checkpoint_is_one_clear_line(tmp_path):
    path, key = _saved(tmp_path)
    key.unlink()
    with pytest.raises(IntegrityError) as info:
        load_checkpoint(path, RUN, key)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and str(key) in msg and "missing" in msg
    assert not key.exists()  # loading never creates a key that would then fail the MAC


def test_missing_key_without_checkpoint_is_a_fresh_start(tmp_path):
    assert load_checkpoint(tmp_path / "none.ckpt", RUN, tmp_path / "keys" / "coordinator.hmac") is None


def test_short_key_file_is_refused_naming_it(tmp_path):
    path, key = _saved(tmp_path)
    key.write_bytes(b"short")
    with pytest.raises(IntegrityError, match=f"coordinator key {key} holds 5 bytes"):
        load_checkpoint(path, RUN, key)


@pytest.mark.parametrize("where", ["meta", "tensor"])
def test_corruption_is_still_refused_as_corruption(tmp_path, where):
    path, key = _saved(tmp_path)
    offset = path.read_bytes().index(b"\n") + 10 if where == "meta" else path.stat().st_size - 100
    _flip(path, offset)
    with pytest.raises(IntegrityError, match=f"{path} fails its sha256 check"):
        load_checkpoint(path, RUN, key)


def test_version_one_checkpoint_is_refused(tmp_path):
    path, key = _saved(tmp_path)
    header, body = _split(path)
    header["version"] = 1
    _write(path, header, body)
    with pytest.raises(IntegrityError, match="format version 1"):
        load_checkpoint(path, RUN, key)


def test_keys_folder_is_git_ignored():
    root = Path(__file__).resolve().parents[1]
    assert "/keys/" in (root / ".gitignore").read_text().split()
    assert "keys" not in (root / "dvc.yaml").read_text().replace("key_fingerprint", "")
