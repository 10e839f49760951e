"""INV-PINNED-KEYS: keys are created at the site (`lensemble site keygen`), pinned by fingerprint in
params, and never trusted on first use: impostors, unknown sites and mismatched keys are refused
with an IntegrityError naming the site."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lensemble.config import parse_params
from lensemble.errors import ConfigError, IntegrityError
from lensemble.federation.exchange import Exchange
from lensemble.federation.rounds import InlineSites, NesterovStep, SiteEndpoint, run_round
from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport
from lensemble.federation.signing import key_fingerprint
from lensemble.federation.transport import RoundContext, param_spec
from lensemble.federation.transports import aggregator_codec, site_codec
from lensemble.paths import Layout
from orchestration.site_agent import enrol, key_path, keygen, public_key_name, read_public_key, register_peers
from tests.conftest import REPO, micro_params

SITES = ("site_a", "site_b")


def _fp(key: Ed25519PrivateKey) -> str:
    """The closed form: SHA-256 of the raw 32-byte public key."""
    return hashlib.sha256(key.public_key().public_bytes_raw()).hexdigest()


def _params(pins: dict[str, str]):
    raw = micro_params()
    for s in raw["data"]["sites"]:
        s["key_fingerprint"] = pins[s["name"]]
    raw["federate"].update(execution="sovereign", site_launch="task", exchange="exchange")
    return parse_params(raw)


@pytest.fixture
def ex():
    return Exchange(f"memory://pinned-{uuid.uuid4().hex}")


def _cli(root, *args):
    return subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_keygen_prints_the_fingerprint_of_the_key_it_wrote(tmp_path):
    out = _cli(tmp_path, "site", "keygen", "site_a")
    assert out.returncode == 0, out.stderr
    path = key_path(Layout(tmp_path), "site_a")
    key = Ed25519PrivateKey.from_private_bytes(path.read_bytes())
    assert path.stat().st_mode & 0o777 == 0o600
    assert f"fingerprint: {_fp(key)}" in out.stdout
    assert f"    key_fingerprint: {_fp(key)}" in out.stdout.splitlines()  # the params line to paste
    assert key_fingerprint(key.public_key()) == _fp(key)


def test_keygen_keeps_an_existing_key_and_force_replaces_it(tmp_path):
    layout = Layout(tmp_path)
    first, created = keygen(layout, "site_a")
    raw = key_path(layout, "site_a").read_bytes()
    assert created and keygen(layout, "site_a") == (first, False) and key_path(layout, "site_a").read_bytes() == raw
    second, created = keygen(layout, "site_a", force=True)
    assert created and second != first
    assert second == _fp(Ed25519PrivateKey.from_private_bytes(key_path(layout, "site_a").read_bytes()))


def test_keygen_refuses_a_name_that_is_not_a_site_name_in_one_line(tmp_path):
    out = _cli(tmp_path, "site", "keygen", "../etc")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and "site name '../etc' must match" in out.stderr
    assert not (tmp_path / "keys").exists()


def test_enrol_never_creates_a_key(tmp_path, ex):
    pins = {s: "0" * 64 for s in SITES}
    with pytest.raises(ConfigError, match="site site_a has no signing key .* run `lensemble site keygen site_a`"):
        enrol(Layout(tmp_path), ex, "site_a", _params(pins))
    assert not key_path(Layout(tmp_path), "site_a").exists() and not list(ex.fs.find(ex.base))


def test_a_site_whose_key_is_not_the_pinned_one_refuses_to_run(tmp_path, ex):
    layout = Layout(tmp_path)
    keygen(layout, "site_a")
    pins = {"site_a": "ab" * 32, "site_b": "cd" * 32}
    with pytest.raises(IntegrityError, match="site 'site_a': its signing key .* not the pinned abab") as err:
        enrol(layout, ex, "site_a", _params(pins))
    assert err.value.site == "site_a" and not list(ex.fs.find(ex.base))  # nothing published


def test_an_impostor_who_publishes_first_is_refused_and_the_pinned_key_wins(tmp_path, ex):
    real, mallory = Layout(tmp_path / "real"), Layout(tmp_path / "mallory")
    pinned, _ = keygen(real, "site_a")
    forged, _ = keygen(mallory, "site_a")  # an impostor's own key for site_a
    impostor = Ed25519PrivateKey.from_private_bytes(key_path(mallory, "site_a").read_bytes())
    ex.put(public_key_name("site_a", forged), impostor.public_key().public_bytes_raw())  # first on the exchange
    ex.put("keys/site_a.pub", impostor.public_key().public_bytes_raw())  # the old trust-on-first-use name, too
    assert read_public_key(ex, "site_a", pinned) is None  # the coordinator reads only the pinned name
    key = enrol(real, ex, "site_a", _params({"site_a": pinned, "site_b": "0" * 64}))  # the real site is not blocked
    assert read_public_key(ex, "site_a", pinned).public_bytes_raw() == key.public_key().public_bytes_raw()
    aggregator = aggregator_codec("secure_int8", 16, {"site_a": pinned, "site_b": "0" * 64})
    with pytest.raises(IntegrityError, match=f"site 'site_a': the signing key presented has fingerprint {forged}") as err:
        aggregator.register("site_a", impostor.public_key())
    assert err.value.site == "site_a"
    aggregator.register("site_a", key.public_key())


def test_a_squatted_pinned_name_is_refused_naming_the_site(tmp_path, ex):
    layout = Layout(tmp_path)
    pinned, _ = keygen(layout, "site_a")
    ex.put(public_key_name("site_a", pinned), Ed25519PrivateKey.generate().public_key().public_bytes_raw())
    with pytest.raises(IntegrityError, match="site 'site_a': the key published under .* does not have the pinned") as err:
        read_public_key(ex, "site_a", pinned)
    assert err.value.site == "site_a"
    with pytest.raises(IntegrityError, match="site 'site_a': the exchange holds other bytes"):
        enrol(layout, ex, "site_a", _params({"site_a": pinned, "site_b": "0" * 64}))


@pytest.mark.parametrize("transport", ["int8", "secure_int8"])
def test_an_unknown_site_is_refused_by_the_registry(transport):
    key = Ed25519PrivateKey.generate()
    aggregator = aggregator_codec(transport, 16, {"site_a": _fp(key)})
    with pytest.raises(IntegrityError, match="site 'mallory' has no pinned key fingerprint") as err:
        aggregator.register("mallory", Ed25519PrivateKey.generate().public_key())
    assert err.value.site == "mallory"


def test_a_site_codec_refuses_its_own_unpinned_key_and_an_unpinned_peer():
    keys = {s: Ed25519PrivateKey.generate() for s in SITES}
    public = {s: k.public_key() for s, k in keys.items()}
    pins = {s: _fp(k) for s, k in keys.items()}
    with pytest.raises(IntegrityError, match="site 'site_a': its own signing key has fingerprint"):
        site_codec("secure_int8", 16, "site_a", Ed25519PrivateKey.generate(), public, pins)
    with pytest.raises(IntegrityError, match="site 'site_b': the signing key presented") as err:
        site_codec("secure_int8", 16, "site_a", keys["site_a"], {**public, "site_b": Ed25519PrivateKey.generate().public_key()}, pins)
    assert err.value.site == "site_b"
    site_codec("secure_int8", 16, "site_a", keys["site_a"], public, pins)


def test_register_peers_refuses_a_peer_without_a_pin(tmp_path, ex):
    keys = {s: Ed25519PrivateKey.generate() for s in SITES}
    pins = {"site_a": _fp(keys["site_a"])}
    codec = site_codec("secure_int8", 16, "site_a", keys["site_a"], {}, pins)
    ex.put(public_key_name("site_a", pins["site_a"]), keys["site_a"].public_key().public_bytes_raw())
    with pytest.raises(IntegrityError, match="peer 'site_b' has no pinned key fingerprint") as err:
        register_peers(ex, codec, "site_a", SITES, pins)
    assert err.value.site == "site_b"


def test_no_key_is_enrolled_on_first_use():
    ctx = RoundContext("r", 0, ("a", "b"), (("w", (4,)),))
    for codec in (SecureInt8Transport({}, block=16), Int8Transport({"a": Ed25519PrivateKey.generate()}, block=16)):
        with pytest.raises(ConfigError, match="no Ed25519 signing key for site 'b'"):
            codec.encode(ctx, "b", {"w": torch.zeros(4)}) if codec.name == "int8" else codec.key_share(ctx, "b")
    # an update signed by a key nobody registered is refused, not enrolled
    signer = Int8Transport({"b": Ed25519PrivateKey.generate()}, block=16)
    aggregator = Int8Transport({}, block=16)
    payloads = {s: signer.encode(ctx, "b", {"w": torch.ones(4)}) for s in ("b",)}
    with pytest.raises(IntegrityError, match="'b': no registered signing key"):
        aggregator.verify(RoundContext("r", 0, ("b",), ctx.spec), payloads)


def test_a_pool_presenting_an_impostor_key_drops_that_site_and_the_round_goes_on():
    keys = {s: Ed25519PrivateKey.generate() for s in ("a", "b", "c")}
    pins = {s: _fp(k) for s, k in keys.items()}
    impostor = Ed25519PrivateKey.generate()
    delta = {"w": torch.full((32,), 0.01)}
    endpoints = {}
    for s in ("a", "b", "c"):
        key = impostor if s == "b" else keys[s]
        public = {p: (impostor if p == "b" else keys[p]).public_key() for p in ("a", "c")} | {s: key.public_key()}
        endpoints[s] = SiteEndpoint(s, site_codec("secure_int8", 16, s, key, public), lambda: delta, public_key=key.public_key())
    params = {"w": torch.zeros(32)}
    res = run_round("run", 0, ("a", "b", "c"), param_spec(params), InlineSites(endpoints), aggregator_codec("secure_int8", 16, pins),
                    params, None, NesterovStep(0.7, 0.9))
    assert res.members == ("a", "c") and "IntegrityError: site 'b': the signing key presented" in res.dropped["b"]


def test_sovereign_params_without_a_pin_are_refused_naming_the_site():
    raw = micro_params()
    raw["federate"].update(execution="sovereign")
    with pytest.raises(ConfigError, match="site_a has no key_fingerprint"):
        parse_params(raw)
