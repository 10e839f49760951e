"""The leak scan's native text pass (`text_scan.c`) against the regular-expression reference, bit for bit,
and the one-pass multi-site scan against each site's own scan."""
from __future__ import annotations

import numpy as np
import pytest

from lensemble.data import audit
from lensemble.data.audit import PrivateIndex, frame_keys, scan_data_many, scan_many, value_keys

EDGES = [
    b"1e999 -1e999 1e-400 -0 -0.0 4.9e-324 2.4703282292062328e-324 2.4703282292062329e-324 1.7976931348623157e308",
    b"1.2.3 --5 5. .5 -.5e-3 1e 1e+ 1e-x 3E+07 0.1e-0 12ab34 -. -.e5 .e5 9.",
    b"007 255 256 0255 00000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000001",
    b"1 2 3 4 5 6 7 8 300 9 10 11 12 13 14 15 16 17 -1 1 2 3 4 5 6 7 8",
    b"[" + b", ".join(str(i).encode() for i in range(300)) + b"]",
    b"0." + b"3" * 400 + b"e-5 " + b"9" * 330 + b" 1" + b"0" * 309,
    b"QUJDREVGR0hJSktMTU5P QUJDREVGR0hJSktMTU5PUA QUJDREVGR0hJSktMTU5PUA= QUJDREVGR0hJSktMTU5PUA=== QUJDREVGR0hJSkt+/+/A",
    b"abcdefghijk ABCDEFGHIJKL abcdefghijklm= x0123456789abcdef 0123456789ABCDEF0 0123456789abcde 00112233445566778899aabbccddeeff",
    b"", b"-", b".", b"5", b"e5", b"=",
]


def _reference(data: bytes) -> tuple[np.ndarray, bytes]:
    nums, runs = audit._text_numbers(data)
    return np.asarray(nums, np.float64), audit._SEP.join([*audit._decoded(data, ".txt"), *runs])


def _fuzz(seed: int, n: int) -> bytes:
    """Bytes dense in what the text pass parses: digits, signs, points, exponents, base64 and hex runs, padding."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"0123456789" * 6 + b"..--eE++==//" + b"abcdefABCDEFxyzXYZ" + b" ,:;[]\"'\n\x00\xff", np.uint8)
    out = alphabet[rng.integers(0, len(alphabet), n)]
    for start in rng.integers(0, max(n - 40, 1), n // 200):  # some long runs of one kind
        kind = rng.integers(3)
        length = int(rng.integers(8, 40))
        pool = (b"0123456789", b"0123456789abcdefABCDEF", b"ABCXYZabcxyz0189+/")[kind]
        out[start : start + length] = np.frombuffer(pool, np.uint8)[rng.integers(0, len(pool), len(out[start : start + length]))]
    return out.tobytes()


@pytest.fixture(scope="module")
def lib():
    lib = audit._text_lib()
    if lib is None:
        pytest.skip("no C compiler: text_scan.c cannot be built here (the reference path is then the scan)")
    return lib


@pytest.mark.parametrize("case", range(len(EDGES)))
def test_native_text_pass_matches_the_regular_expressions_on_edge_cases(lib, case):
    data = EDGES[case]
    nums, groups = audit._native_parts(lib, data)
    ref_nums, ref_joined = _reference(data)
    assert nums.view(np.uint64).tolist() == ref_nums.view(np.uint64).tolist()  # bit for bit: -0.0, inf, subnormals
    assert audit._SEP.join(groups) == ref_joined


def test_native_text_pass_matches_the_regular_expressions_on_dense_random_bytes(lib):
    for seed in range(40):
        data = _fuzz(seed, 20_000)
        nums, joined = audit._text_parts(data, ".bin")
        ref_nums, ref_joined = _reference(data)
        assert nums.view(np.uint64).tolist() == ref_nums.view(np.uint64).tolist(), seed
        assert joined == ref_joined, seed
    assert len(ref_nums) > 1000 and len(ref_joined) > 1000  # the fuzz reaches every kind of part


def test_native_candidates_are_the_numpy_candidates(lib):
    rng = np.random.default_rng(0)
    bitmap = rng.random(1 << audit._BITS) < 0.01
    for n in (0, 7, 8, 9, 64, 100_003):
        arr = rng.integers(0, 256, n, dtype=np.uint8)
        got, ref = audit._candidates(arr, bitmap), audit._numpy_candidates(arr, bitmap)
        order = np.argsort(ref[0])
        assert got[0].tolist() == ref[0][order].tolist() and got[1].tolist() == ref[1][order].tolist()
    assert len(ref[0]) > 500
    dense = np.ones(1 << audit._BITS, bool)  # every word a candidate: the output buffer is grown, not overrun
    arr = rng.integers(0, 256, 10_000, dtype=np.uint8)
    assert audit._candidates(arr, dense)[0].tolist() == list(range(10_000 - 7))


def _site(seed: int) -> tuple[PrivateIndex, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((4, 40)).astype(np.float32)
    frames = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    return PrivateIndex(value_keys(values), frame_keys(frames)), values, frames


def test_one_pass_over_many_sites_counts_what_each_sites_own_scan_counts(monkeypatch):
    sites = {name: _site(seed) for seed, name in enumerate(("a", "b", "c"))}
    indexes = {name: s[0] for name, s in sites.items()}
    _, va, fa = sites["a"]
    _, vb, _ = sites["b"]
    text = ", ".join(f"{float(x):.9g}" for x in vb[1]).encode()  # site b's row as text numbers
    blob = b"head" + va[0].tobytes() + b"x" * 5 + fa[2].tobytes() + text + vb[2, 3:9].tobytes() + fa[0].astype(np.uint8).tobytes()[1:]
    for native in (True, False):
        if not native:
            monkeypatch.setattr(audit, "_text_lib", lambda: None)
        found = scan_data_many(blob, ".bin", indexes)
        for name, index in indexes.items():
            nums, joined = audit._text_numbers(blob)[0], audit._SEP.join([*audit._decoded(blob, ".bin"), *audit._text_numbers(blob)[1]])
            own = index.scan(blob)
            own = {"values": own["values"] + index.scan(joined)["values"] + index.scan_floats(nums),
                   "frames": own["frames"] + index.scan(joined)["frames"]}
            assert found[name] == own, (native, name)
        assert found["a"]["values"] > 0 and found["a"]["frames"] == 1  # the planted rows are found
        assert found["b"]["values"] > 0 and found["c"] == {"values": 0, "frames": 0}
        assert scan_many(blob, {}) == {}


def test_a_text_pair_counts_only_when_its_decimal_forms_are_improbable_by_chance():
    # The false alarm this rule fixes: the point mass's x = 0.07424 (a private float32 that is a 4-digit decimal)
    # after a zero velocity, and a Prefect run time "total_run_time": 0.07424 after a "0" in a database with no
    # private row. A short pair is as likely a coincidence as a leak; the same value beside a full-precision
    # neighbour, as a leaked stream writes it, still counts, and raw bytes count whatever their values.
    stream = np.array([[0.12345679, 0.0, 0.07424, 0.17514472, -0.37386632]], np.float32)
    index = PrivateIndex(value_keys(stream), np.zeros((0, 6), np.uint64))
    assert [audit.significant_digits(np.float32(x)) for x in stream[0]] == [8, 1, 4, 8, 8]
    assert index.scan_floats([0.0, 0.07424]) == 0  # 1 + 4 digits
    assert index.scan_floats([0.07424, float(np.float32(0.17514472))]) == 1  # 4 + 8
    assert index.scan_floats([float(np.float32(0.12345679)), 0.0]) == 1  # 8 + 1, the rule's floor
    assert index.scan_floats([float(x) for x in stream[0]]) == 3
    assert scan_data_many(b'{"state": "COMPLETED", "retries": 0, "total_run_time": 0.07424}', ".json", {"s": index}) == {
        "s": {"values": 0, "frames": 0}}
    leaked = ", ".join(f"{float(x):.9g}" for x in stream[0]).encode()  # the stream as text
    assert scan_data_many(leaked, ".json", {"s": index})["s"]["values"] == 3
    assert scan_data_many(stream[0, 1:3].tobytes(), ".bin", {"s": index})["s"]["values"] == 1  # (0, 0.07424) as raw bytes
    assert [audit.significant_digits(x) for x in (np.float32(np.inf), np.float32(np.nan), np.float32(-1.5e-7))] == [0, 0, 2]
