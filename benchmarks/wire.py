"""Wire-path benchmarks: mask keystream, a site's whole secure_int8 path, the aggregator's whole path.

`bench_client` and `bench_aggregate` time what a party does in a round, end to end, native and eager,
each beside the memory copy floor of the bytes it must move (`perf.copy_bandwidth`, same run);
`bench_keystream` and `bench_quant_mask` time parts (quantize + mask alone is not the client's cost).

Pure functions returning plain dicts of numbers; they write nothing. Everything runs on one core
(`torch.set_num_threads(1)`, restored afterwards) so figures compare across machines. `lensemble
bench wire` runs them in the suite; full size alone:

    python -c "from benchmarks import wire
    print(wire.bench_keystream(), wire.bench_client(), wire.bench_aggregate(), sep='\\n')"
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from lensemble.federation import native, secagg
from lensemble.federation.outer import DEFAULT_CHUNK, apply_outer_step, outer_step_chunk
from lensemble.federation.quant import DEFAULT_BLOCK, quantize_int8
from lensemble.federation.secure_transport import SecureInt8Transport
from lensemble.federation.signing import generate_site_keys
from lensemble.federation.transport import RoundContext
from lensemble.perf import best_seconds, copy_bandwidth, torch_threads


@contextmanager
def native_disabled() -> Iterator[None]:
    """Run the aggregator's eager path, as without a C compiler (`LENSEMBLE_NATIVE=0`)."""
    before = os.environ.get("LENSEMBLE_NATIVE")
    os.environ["LENSEMBLE_NATIVE"] = "0"
    native.load.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LENSEMBLE_NATIVE")
        else:
            os.environ["LENSEMBLE_NATIVE"] = before
        native.load.cache_clear()


def bench_keystream(num_bytes: int = 256 << 20, repeats: int = 3, num_peers: int = 4) -> dict[str, float]:
    """ChaCha20 keystream throughput (GB/s), and that of whole masks (`site_mask`, Z_{2^16}).

    `mask_gbps` counts the keystream bytes of one site's mask with `num_peers` peers, each mask
    num_bytes / num_peers long: key agreement, HKDF, keystream and ring additions included.
    """
    with torch_threads(1):
        zeros, out = bytes(num_bytes), bytearray(num_bytes)
        key = os.urandom(32)
        keystream_s = best_seconds(lambda: secagg.keystream_into(key, zeros, memoryview(out)), repeats)
        keys = {f"s{i}": X25519PrivateKey.generate() for i in range(num_peers + 1)}
        public = {site: k.public_key().public_bytes_raw() for site, k in keys.items()}
        numel = num_bytes // num_peers // 2
        mask_s = best_seconds(lambda: secagg.site_mask("s0", keys["s0"], public, "bench", 0, "s", numel, 16), repeats)
    return {
        "num_bytes": float(num_bytes),
        "keystream_gbps": num_bytes / keystream_s / 1e9,
        "mask_gbps": 2 * numel * num_peers / mask_s / 1e9,
    }


def bench_quant_mask(
    numel: int = 10_000_000, num_sites: int = 8, block: int = DEFAULT_BLOCK, repeats: int = 2
) -> dict[str, float]:
    """Seconds for one site of a secure_int8 round: quantize its update, draw its C-1 pair masks, add."""
    with torch_threads(1):
        x_N = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        keys = {f"s{i}": X25519PrivateKey.generate() for i in range(num_sites)}
        public = {site: key.public_key().public_bytes_raw() for site, key in keys.items()}
        q_N, _ = quantize_int8(x_N, block)
        quantize_s = best_seconds(lambda: quantize_int8(x_N, block), repeats)
        mask_s = best_seconds(lambda: secagg.site_mask("s0", keys["s0"], public, "bench", 0, "s", numel, 16), repeats)
        mask_N = secagg.site_mask("s0", keys["s0"], public, "bench", 0, "s", numel, 16)
        add_s = best_seconds(lambda: secagg.mask_codes(q_N, mask_N, 16), repeats)
    return {
        "numel": float(numel), "num_sites": float(num_sites), "quantize_s": quantize_s, "mask_s": mask_s,
        "add_s": add_s, "total_s": quantize_s + mask_s + add_s,
    }


def _secure_round(num_sites: int, numel: int, block: int, num_tensors: int = 1):
    """A secure_int8 round's setup at C sites: (transport, ctx, delta(i)); every party in one object."""
    sizes = [numel // num_tensors + (i < numel % num_tensors) for i in range(num_tensors)]
    spec = tuple((f"w{i}", (n,)) for i, n in enumerate(sizes))
    sites = tuple(f"s{i}" for i in range(num_sites))
    ctx = RoundContext("bench", 0, sites, spec)
    transport = SecureInt8Transport(generate_site_keys(sites), block=block)

    def delta(i: int) -> dict[str, torch.Tensor]:  # regenerated, so only one update is alive at a time
        g = torch.Generator().manual_seed(i)
        return {name: torch.randn(shape, generator=g) * 1e-3 for name, shape in spec}

    transport.begin_round(ctx)
    return transport, ctx, delta


def bench_client(
    numel: int = 10_000_000, num_sites: int = 8, block: int = DEFAULT_BLOCK, num_tensors: int = 10,
    copy_bytes: int = 256 << 20, repeats: int = 3,
) -> dict[str, float]:
    """Seconds of one site's whole secure_int8 round at N parameters (in `num_tensors` tensors), C - 1 neighbours.

    `total_s` = `announce` + `encode`: the checks, the block absmax of w_c Δ_c, quantization on the
    shared grid, the C - 1 pair masks (X25519, HKDF, ChaCha20), serialization and the Ed25519 /
    SHA-256 signature, on the native kernel; `eager_s` the same as without a C compiler. Floor = bytes
    that must move / copy bandwidth: read Δ_c twice (announce, then encode after the grid: 8 N), write
    the body (2 N), read it to sign (2 N). The keystreams are computed in cache and not counted.
    `crypto_s` is the compute the wire format fixes, timed alone in the same run: C - 1 ChaCha20
    keystreams of 2 N bytes and one SHA-256 of the 2 N byte body; `ratio_beyond_crypto` =
    (total_s - crypto_s) / floor_s, what the rest of the path costs against the floor.
    """
    with torch_threads(1):
        transport, ctx, delta = _secure_round(num_sites, numel, block, num_tensors)
        transport.agree(ctx, {site: transport.announce(ctx, site, delta(i)) for i, site in enumerate(ctx.site_ids)})
        site, delta_0 = ctx.site_ids[0], delta(0)
        announce_s = best_seconds(lambda: transport.announce(ctx, site, delta_0), repeats)
        encode_s = best_seconds(lambda: transport.encode(ctx, site, delta_0), repeats)
        with native_disabled():
            eager_announce_s = best_seconds(lambda: transport.announce(ctx, site, delta_0), repeats)
            eager_encode_s = best_seconds(lambda: transport.encode(ctx, site, delta_0), repeats)
        zeros, body = bytes(2 * numel), bytearray(2 * numel)
        key = os.urandom(32)
        keystream_s = best_seconds(lambda: secagg.keystream_into(key, zeros, memoryview(body)), repeats)
        sha_s = best_seconds(lambda: hashlib.sha256(body).digest(), repeats)
    crypto_s = (num_sites - 1) * keystream_s + sha_s
    bandwidth = copy_bandwidth(copy_bytes)
    floor_s = 12 * numel / bandwidth
    total_s, eager_s = announce_s + encode_s, eager_announce_s + eager_encode_s
    return {
        "numel": float(numel), "num_sites": float(num_sites), "announce_s": announce_s, "encode_s": encode_s,
        "total_s": total_s, "eager_announce_s": eager_announce_s, "eager_encode_s": eager_encode_s, "eager_s": eager_s,
        "copy_gbps": bandwidth / 1e9, "floor_s": floor_s, "ratio": total_s / floor_s, "ratio_eager": eager_s / floor_s,
        "native": float(native.load() is not None), "crypto_s": crypto_s,
        "ratio_beyond_crypto": (total_s - crypto_s) / floor_s,
    }


def bench_aggregate(
    num_sites: int = 8, numel: int = 10_000_000, block: int = DEFAULT_BLOCK, copy_bytes: int = 256 << 20,
    repeats: int = 3,
) -> dict[str, float]:
    """Seconds of the aggregator's secure_int8 round at C sites and N parameters, against a floor.

    `total_s` is `outer.apply_outer_step`: the exact ring sum, dequantization and outer Nesterov
    step, fused chunk by chunk, with the INV-AGG-DETERMINISM self-check (every chunk evaluated twice),
    writing into the buffers of the round before last as a long-running aggregator does.
    `fresh_alloc_s` is the same into newly allocated tensors (page faults included);
    `one_evaluation_s` the eager path evaluated once, without its self-check (for reference only);
    `eager_s` the whole step on the NumPy/torch path, as on a machine without a C compiler.
    `signature_verify_s` is `Transport.verify` (SHA-256 + Ed25519 of every payload, bindings,
    replay), which an aggregator runs per update as it arrives; it is reported beside, not inside.
    `path_s` is the whole path once the messages are in: `agree` + `verify` + the step (`path_eager_s`
    eager). Floor = bytes that must move / copy bandwidth: read C masked payloads (2 C N bytes), read
    the params and momentum buffer (8 N) and write both back (8 N). `ratio` = total_s / floor; the
    whole path reads the payloads twice (signatures, then the sum), so its ratio counts that against it.
    """
    with torch_threads(1):
        transport, ctx, delta = _secure_round(num_sites, numel, block)
        announcements = {site: transport.announce(ctx, site, delta(i)) for i, site in enumerate(ctx.site_ids)}
        transport.agree(ctx, announcements)
        payloads = {site: transport.encode(ctx, site, delta(i)) for i, site in enumerate(ctx.site_ids)}
        (w, _), = ctx.spec
        params = {w: torch.randn(numel)}
        momentum = {w: torch.randn(numel)}
        verify_s = best_seconds(lambda: transport.verify(ctx, payloads), repeats)
        accepted = transport.verify(ctx, payloads)
        out = ({w: torch.empty(numel)}, {w: torch.empty(numel)})

        def step(into: tuple | None) -> None:
            apply_outer_step(ctx, transport, accepted, params, momentum, 0.7, 0.9, out=into)

        def whole_path() -> None:  # what the aggregator does once the announcements and updates are in
            transport.agree(ctx, announcements)
            apply_outer_step(ctx, transport, transport.verify(ctx, payloads), params, momentum, 0.7, 0.9, out=out)

        total_s = best_seconds(lambda: step(out), repeats)
        path_s = best_seconds(whole_path, repeats)
        fresh_s = best_seconds(lambda: step(None), repeats)

        def one_evaluation() -> None:  # the eager path's chunks, without the self-check's second evaluation
            scratch = torch.empty(DEFAULT_CHUNK)
            for a in range(0, numel, DEFAULT_CHUNK):
                b = min(a + DEFAULT_CHUNK, numel)
                outer_step_chunk(transport, ctx, accepted, a, params[w][a:b], momentum[w][a:b], scratch[: b - a],
                                 out[0][w][a:b], out[1][w][a:b], 0.7, 0.9)

        with native_disabled():
            one_s = best_seconds(one_evaluation, repeats)
            eager_s = best_seconds(lambda: step(out), repeats)
            path_eager_s = best_seconds(whole_path, repeats)
    bandwidth = copy_bandwidth(copy_bytes)
    floor_s = (2 * num_sites * numel + 16 * numel) / bandwidth
    return {
        "num_sites": float(num_sites), "numel": float(numel), "signature_verify_s": verify_s,
        "verify_gbps": 2 * num_sites * numel / verify_s / 1e9, "total_s": total_s, "fresh_alloc_s": fresh_s,
        "copy_gbps": bandwidth / 1e9, "floor_s": floor_s, "ratio": total_s / floor_s,
        "ratio_fresh_alloc": fresh_s / floor_s, "one_evaluation_s": one_s, "ratio_one_evaluation": one_s / floor_s,
        "native": float(transport.fused_kernel(ctx, accepted, 0.7, 0.9) is not None), "eager_s": eager_s, "ratio_eager": eager_s / floor_s,
        "path_s": path_s, "path_ratio": path_s / floor_s, "path_eager_s": path_eager_s,
        "path_ratio_eager": path_eager_s / floor_s,
    }
