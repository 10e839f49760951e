"""A site's secure_int8 passes over its update, each one read of Δ_c: the block absmax, then the masked codes.

`secure_transport` announces max_b |w_c Δ_c| and later encodes y = q(w_c Δ_c) + M_c mod 2^k. Done
naively each step flattens Δ_c into a fresh fp32 vector, weights it into another, checks it for
NaN/Inf and the quantizer's domain in separate passes, draws the whole mask M_c (C - 1 keystreams
of N ring elements, each added in its own pass) and concatenates header, body and signature; at
10M parameters those copies were most of a site's time. Here each pass reads the tensors of Δ_c where they lie,
weights every element in a register, and in the same pass checks |w_c x| <= MAX_ABS (which also
rejects NaN and Inf) and, while encoding, |w_c x| <= the announced block absmax (the update must
not have grown since the announcement); the codes and the mask go straight into the payload buffer.
w_c Δ_c is never stored: reading Δ_c again costs less than writing and re-reading a weighted copy.

The work runs in chunks of CHUNK parameters (whole quantization blocks) so that the chunk's C - 1
pair keystreams (`secagg.pair_streams`, read in order) sit in L2 when they are added. A chunk is
done by `client_step.c` (`native.load()`), or else by the eager torch/NumPy ops of `quant` and
`secagg`; both give the bytes of the reference (`quantize_with_scales` on the weighted vector, then
`site_mask` and `mask_codes`), which tests/test_client_path.py checks on adversarial inputs.

A pass that finds a bad value returns None / False and writes nothing the caller keeps; the caller
names the failure with the eager checks (`secure_transport._site_vector`), so the errors are those
of the reference.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from lensemble.errors import IntegrityError
from lensemble.federation import native, secagg
from lensemble.federation.quant import MAX_ABS, block_absmax, num_blocks, quantize_with_scales
from lensemble.federation.transport import RoundContext, check_frozen

CHUNK = 1 << 15
"""Parameters per chunk (rounded to whole blocks): 64 KiB of each 16-bit keystream, 7 of them in L2."""


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype, _bytes_data.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def new_payload(size: int) -> tuple[bytes, np.ndarray]:
    """A new `bytes` of `size` (> 1) bytes and a writable [size] uint8 view of it, to fill before it escapes.

    C extensions build bytes this way (`PyBytes_FromStringAndSize(NULL, size)`, then write): a payload is
    written once, where it will live, and is still `bytes`, which the residency guard requires. Its hash
    is computed on first use, after the filling; nothing may write through the view once it is shared.
    The view keeps the bytes alive.
    """
    assert size > 1, "size 0 and 1 return shared bytes objects"
    payload = _new_bytes(None, size)
    storage = (ctypes.c_ubyte * size).from_address(_bytes_data(payload))
    storage.owner = payload  # the view's base holds the bytes it points into
    return payload, np.ctypeslib.as_array(storage)


def check_layout(ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> None:
    """Names and shapes of Δ_c against the round's spec, and zeros on its frozen prefix (`transport.check_delta`
    without the value pass over what travels)."""
    if site not in ctx.site_ids:
        raise IntegrityError(f"site {site!r} is not in the federation {list(ctx.site_ids)}", site=site)
    names, expected = tuple(sorted(delta)), tuple(name for name, _ in ctx.spec)
    if names != expected:
        extra, missing = sorted(set(names) - set(expected)), sorted(set(expected) - set(names))
        raise IntegrityError(f"update from {site!r} has wrong names: extra {extra}, missing {missing}", site=site)
    for name, shape in ctx.spec:
        if tuple(delta[name].shape) != shape:
            raise IntegrityError(f"update from {site!r}: {name} has shape {tuple(delta[name].shape)}, expected {shape}",
                                 site=site)
    check_frozen(ctx, site, delta)


def flat_segments(ctx: RoundContext, delta: Mapping[str, torch.Tensor], start: int = 0) -> list[torch.Tensor]:
    """Δ_c[start:] as flat contiguous fp32 CPU tensors, one per tensor it touches, in spec order (views when they already are)."""
    segments, offset = [], 0
    for name, shape in ctx.spec:
        n = math.prod(shape)
        if offset + n > start:
            flat = delta[name].detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
            segments.append(flat[max(0, start - offset) :])
        offset += n
    return segments


def _chunks(segments: Sequence[torch.Tensor], chunk: int) -> Iterator[tuple[int, int, list[tuple[int, torch.Tensor]]]]:
    """(a, b, pieces) over the concatenation of `segments` in steps of `chunk`; pieces are (offset in the chunk, view)."""
    n = sum(s.numel() for s in segments)
    seg, seg_start = 0, 0
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        pieces, pos = [], a
        while pos < b:
            while pos >= seg_start + segments[seg].numel():
                seg_start += segments[seg].numel()
                seg += 1
            end = min(b, seg_start + segments[seg].numel())
            pieces.append((pos - a, segments[seg][pos - seg_start : end - seg_start]))
            pos = end
        yield a, b, pieces


def _gather(pieces: list[tuple[int, torch.Tensor]], weight_: torch.Tensor, out_n: torch.Tensor) -> torch.Tensor:
    """w_c x of one chunk into `out_n` (the eager path's copy, in cache), as torch's x * tensor(w) rounds it."""
    for offset, x_n in pieces:
        torch.mul(x_n, weight_, out=out_n[offset : offset + x_n.numel()])
    return out_n


def _in_domain(x_n: torch.Tensor) -> bool:
    return bool((x_n.abs() <= MAX_ABS).all())  # false for NaN and Inf too


def weighted_absmax(segments: Sequence[torch.Tensor], weight: float, block: int) -> torch.Tensor | None:
    """max_b |w x| per block of the concatenated segments: -> [nb] fp32 (zeros as +0), or None if a value fails a check."""
    n = sum(s.numel() for s in segments)
    absmax_B = torch.zeros(num_blocks(n, block), dtype=torch.float32)
    weight_ = torch.tensor(weight, dtype=torch.float32)
    chunk = block * max(1, CHUNK // block)
    lib = native.load()
    scratch_n = torch.empty(min(n, chunk), dtype=torch.float32) if lib is None else None
    for a, b, pieces in _chunks(segments, chunk):
        if lib is not None:
            for offset, x_n in pieces:
                if lib.lens_weighted_absmax(x_n.data_ptr(), x_n.numel(), a + offset, float(weight_), block, MAX_ABS,
                                            absmax_B.data_ptr()) >= 0:
                    return None
        else:
            x_n = _gather(pieces, weight_, scratch_n[: b - a])
            if not _in_domain(x_n):
                return None
            absmax_B[a // block : num_blocks(b, block)] = block_absmax(x_n, block)
    return absmax_B


def quantize_mask_into(
    segments: Sequence[torch.Tensor], weight: float, scales_B: torch.Tensor, announced_B: torch.Tensor,
    streams: Sequence[secagg.PairStream], ring_bits: int, block: int, body_N: np.ndarray,
    hash_update: Callable[[np.ndarray], object] | None = None,
) -> bool:
    """y = q(w x) + M mod 2^k into `body_N` ([N] ring dtype, a view of the payload); False if a value fails a check.

    q is `quantize_with_scales` on the grid `scales_B`; every |w x| must be <= MAX_ABS and <= its block's
    `announced_B`. M is the sum of `streams`, which this reads to their next N elements. `hash_update`
    (a hashlib object's `update`) is given each chunk of the body as soon as it is written, while it is in cache.
    """
    dtype = secagg.ring_dtype(ring_bits)
    n, nb = sum(s.numel() for s in segments), num_blocks(body_N.shape[0], block)
    # the kernel indexes these by block and element: a mismatch would read or write out of bounds
    assert body_N.shape == (n,) and body_N.dtype == dtype, "the body must hold N ring elements"
    assert scales_B.shape == announced_B.shape == (nb,), "one scale and one announced absmax per block"
    assert scales_B.dtype == announced_B.dtype == torch.float32, "scales and announcements are fp32"
    weight_ = torch.tensor(weight, dtype=torch.float32)
    chunk = block * max(1, CHUNK // block)
    width = min(body_N.shape[0], chunk)
    zeros = memoryview(bytes(width * dtype.itemsize))
    ks_PK = np.empty((len(streams), width), dtype=dtype)  # this chunk's keystream of every pair
    lib = native.load()
    if lib is not None:
        adds_P = np.array([s.adds for s in streams], dtype=np.int32)
        rows_P = [ks_PK.ctypes.data + p * ks_PK.strides[0] for p in range(len(streams))]
        body_ptr = body_N.ctypes.data
        scales_B, announced_B = scales_B.contiguous(), announced_B.contiguous()
    else:
        x_scratch, mask_n = torch.empty(width, dtype=torch.float32), np.empty(width, dtype=dtype)
    for a, b, pieces in _chunks(segments, chunk):
        for p, stream in enumerate(streams):
            stream.read_into(zeros[: (b - a) * dtype.itemsize], memoryview(ks_PK[p, : b - a]).cast("B"))
        if lib is not None:
            for offset, x_n in pieces:
                ks = (ctypes.c_void_p * max(1, len(streams)))(*[row + offset * dtype.itemsize for row in rows_P])
                bad = lib.lens_quantize_mask(
                    x_n.data_ptr(), x_n.numel(), a + offset, float(weight_), block, scales_B.data_ptr(),
                    announced_B.data_ptr(), MAX_ABS, ks, adds_P.ctypes.data, len(streams), ring_bits,
                    body_ptr + (a + offset) * dtype.itemsize,
                )
                if bad >= 0:
                    return False
        else:
            x_n = _gather(pieces, weight_, x_scratch[: b - a])
            blocks = slice(a // block, num_blocks(b, block))
            if not _in_domain(x_n) or bool((block_absmax(x_n, block) > announced_B[blocks]).any()):
                return False
            m_n = mask_n[: b - a]
            m_n[...] = 0
            for p, stream in enumerate(streams):
                (np.add if stream.adds else np.subtract)(m_n, ks_PK[p, : b - a], out=m_n)
            body_N[a:b] = secagg.mask_codes(quantize_with_scales(x_n, scales_B[blocks], block), m_n, ring_bits)
        if hash_update is not None:
            hash_update(body_N[a:b])
    return True
