"""ClientIdentity: the peer by default, the forwarded client only behind trusted proxies."""

from __future__ import annotations

import logging
from typing import Any, Literal

import pytest

import porch.identity
from porch.errors import ConfigurationError, ForwardingHeaderError
from porch.identity import ClientIdentity, KeyFunc

PEER = ("10.0.0.1", 5555)

Header = Literal["x-forwarded-for", "forwarded"]


def scope(
    *headers: tuple[str, str],
    client: tuple[str, int] | None = PEER,
) -> dict[str, Any]:
    return {
        "type": "http",
        "client": client,
        "headers": [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers],
    }


def xff(value: str) -> tuple[str, str]:
    return ("x-forwarded-for", value)


def fwd(value: str) -> tuple[str, str]:
    return ("forwarded", value)


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "porch.identity" and r.levelno == logging.WARNING
    ]


@pytest.fixture(autouse=True)
def _capture_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="porch.identity")


# --- the default: the peer host -------------------------------------------------------------


def test_default_key_is_peer_host_and_ignores_spoofed_headers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key: KeyFunc = ClientIdentity()
    spoofed = scope(xff("1.2.3.4"), fwd("for=1.2.3.4"), xff("unknown" * 1000))
    assert key(spoofed) == "10.0.0.1"
    assert warnings(caplog) == []


def test_port_is_never_in_the_key() -> None:
    key = ClientIdentity()
    assert key(scope(client=("10.0.0.1", 1111))) == "10.0.0.1"
    assert key(scope(client=("10.0.0.1", 2222))) == "10.0.0.1"
    assert key(scope(client=("2001:db8::1", 3333))) == "2001:db8::/64"


def test_missing_or_none_client_is_unknown() -> None:
    key = ClientIdentity()
    assert key(scope(client=None)) == "unknown"
    assert key({"type": "http", "headers": []}) == "unknown"
    assert ClientIdentity(trust_hops=1)(scope(client=None)) == "unknown"
    assert ClientIdentity(trusted_proxies=["10.0.0.0/8"])(scope(client=None)) == "unknown"


def test_non_ip_peer_is_used_as_is() -> None:
    peer = ("testclient", 50000)
    assert ClientIdentity()(scope(client=peer)) == "testclient"
    assert ClientIdentity(trust_hops=1)(scope(client=peer)) == "testclient"
    trusted = ClientIdentity(trusted_proxies=["10.0.0.0/8"])
    assert trusted(scope(xff("1.2.3.4"), client=peer)) == "testclient"
    assert ClientIdentity()(scope(client=("/run/app:1.sock", 0))) == "/run/app:1.sock"


def test_default_path_parses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(text: str) -> None:
        raise AssertionError(f"parsed {text!r} on the hot path")

    monkeypatch.setattr(porch.identity, "_parse_ip", refuse)
    assert ClientIdentity()(scope(client=("10.0.0.1", 1))) == "10.0.0.1"
    assert ClientIdentity(ipv6_prefix=128)(scope(client=("10.0.0.1", 1))) == "10.0.0.1"


# --- trust_hops -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hops", "header", "expected"),
    [
        (1, "1.1.1.1, 2.2.2.2", "2.2.2.2"),
        (2, "1.1.1.1, 2.2.2.2", "1.1.1.1"),
        (3, "1.1.1.1, 2.2.2.2", "1.1.1.1"),
        (2, "2.2.2.2", "2.2.2.2"),
        (1, " 3.3.3.3 ,4.4.4.4 ", "4.4.4.4"),
    ],
)
def test_trust_hops_picks_the_entry_hops_left_of_the_peer(
    hops: int, header: str, expected: str
) -> None:
    assert ClientIdentity(trust_hops=hops)(scope(xff(header))) == expected


def test_trust_hops_without_header_is_the_peer(caplog: pytest.LogCaptureFixture) -> None:
    assert ClientIdentity(trust_hops=2)(scope()) == "10.0.0.1"
    assert warnings(caplog) == []


def test_trust_hops_behind_a_unix_socket_reads_the_header() -> None:
    # nginx -> uvicorn --uds: no peer address, the proxy's entry names the client.
    assert ClientIdentity(trust_hops=1)(scope(xff("1.2.3.4"), client=None)) == "1.2.3.4"


def test_entries_left_of_the_client_are_not_validated(caplog: pytest.LogCaptureFixture) -> None:
    key = ClientIdentity(trust_hops=1)
    assert key(scope(xff("unknown, _hidden, , garbage, 2.2.2.2"))) == "2.2.2.2"
    forwarded = ClientIdentity(trust_hops=1, header="forwarded")
    # A client's unbalanced quote cannot swallow the element the proxy appended.
    assert forwarded(scope(fwd('for="evil, for=1.2.3.4'))) == "1.2.3.4"
    assert warnings(caplog) == []


def test_multiple_header_lines_are_joined_in_order() -> None:
    s = scope(xff("1.1.1.1"), ("x-other", "9.9.9.9"), xff("2.2.2.2, 3.3.3.3"))
    assert ClientIdentity(trust_hops=1)(s) == "3.3.3.3"
    assert ClientIdentity(trust_hops=2)(s) == "2.2.2.2"
    assert ClientIdentity(trust_hops=3)(s) == "1.1.1.1"
    assert ClientIdentity(trust_hops=4)(s) == "1.1.1.1"


# --- trusted_proxies ------------------------------------------------------------------------


def test_untrusted_peer_ignores_headers(caplog: pytest.LogCaptureFixture) -> None:
    key = ClientIdentity(trusted_proxies=["192.168.0.0/16"])
    assert key(scope(xff("1.2.3.4"))) == "10.0.0.1"
    # Not even an oversized or malformed header is read, so nothing is logged.
    assert key(scope(xff("x" * 10_000))) == "10.0.0.1"
    assert warnings(caplog) == []


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("1.1.1.1, 2.2.2.2, 10.0.0.5", "2.2.2.2"),
        ("10.0.0.9, 2.2.2.2, 10.0.0.5", "2.2.2.2"),
        ("1.1.1.1, 2001:db8::5, 10.0.0.5", "1.1.1.1"),
        ("10.0.0.7, 10.0.0.5", "10.0.0.7"),
        ("garbage, 3.3.3.3", "3.3.3.3"),
        ("x" * 10_000 + ", 3.3.3.3, 10.0.0.5", "3.3.3.3"),
    ],
)
def test_trusted_proxies_walk_to_the_first_untrusted(header: str, expected: str) -> None:
    key = ClientIdentity(trusted_proxies=["10.0.0.0/8", "2001:db8::/64"])
    assert key(scope(xff(header))) == expected


def test_trusted_peer_without_header_is_the_peer() -> None:
    assert ClientIdentity(trusted_proxies=["10.0.0.1"])(scope()) == "10.0.0.1"


def test_trusted_proxies_entries_are_not_strict() -> None:
    key = ClientIdentity(trusted_proxies=[" 10.9.9.9/8 "])
    assert key(scope(xff("1.2.3.4"))) == "1.2.3.4"


# --- address forms --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("1.2.3.4:8080", "1.2.3.4"),
        ("[2001:db8::1]:4711", "2001:db8::1"),
        ("[2001:db8::1]", "2001:db8::1"),
        ("2001:0db8:0000:0000:0000:0000:0000:0001", "2001:db8::1"),
        ("2001:DB8::A", "2001:db8::a"),
        ("::ffff:1.2.3.4", "1.2.3.4"),
        ("[::ffff:1.2.3.4]:80", "1.2.3.4"),
    ],
)
def test_forwarded_addresses_are_normalized(entry: str, expected: str) -> None:
    assert ClientIdentity(trust_hops=1, ipv6_prefix=128)(scope(xff(entry))) == expected


def test_peer_is_normalized_on_the_headers_path() -> None:
    mapped = ("::ffff:10.0.0.1", 1)
    assert ClientIdentity(trust_hops=1)(scope(client=mapped)) == "10.0.0.1"
    # The mapped peer is recognised as inside an IPv4 trusted network.
    trusted = ClientIdentity(trusted_proxies=["10.0.0.0/8"])
    assert trusted(scope(xff("1.2.3.4"), client=mapped)) == "1.2.3.4"


# --- RFC 7239 Forwarded ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hops", "expected"),
    [(1, "198.51.100.17"), (2, "192.0.2.43"), (3, "2001:db8:cafe::17"), (4, "192.0.2.60")],
)
def test_forwarded_elements(hops: int, expected: str) -> None:
    header = (
        'for="192.0.2.60";proto=http, for="[2001:db8:cafe::17]:4711", '
        "for=192.0.2.43:80;proto=https, FOR=198.51.100.17;by=203.0.113.43"
    )
    key = ClientIdentity(trust_hops=hops, header="forwarded", ipv6_prefix=128)
    assert key(scope(fwd(header))) == expected


def test_forwarded_ignores_x_forwarded_for_and_vice_versa() -> None:
    s = scope(xff("1.1.1.1"), fwd("for=2.2.2.2"))
    assert ClientIdentity(trust_hops=1, header="forwarded")(s) == "2.2.2.2"
    assert ClientIdentity(trust_hops=1)(s) == "1.1.1.1"


def test_forwarded_with_trusted_proxies() -> None:
    key = ClientIdentity(trusted_proxies=["10.0.0.0/8"], header="forwarded")
    header = 'for=1.1.1.1, for="[2001:db8::9]";proto=https, for=10.0.0.3'
    assert key(scope(fwd(header))) == "2001:db8::/64"


@pytest.mark.parametrize(
    "header",
    [
        # Catches: Forwarded split on every comma, quoted or not (issue 26, finding 7): a
        # proxy that echoes client text into a quoted parameter let it name the client.
        'for=203.0.113.7;host="a,for=9.9.9.9;x="',
        r'for=203.0.113.7;host="a\",for=9.9.9.9;x=\""',
        r'for=9.9.9.9, for=203.0.113.7;host="a\\,b\\"',
        'for="203.0.113.7";host="a;for=9.9.9.9"',
        r'for="203.0.113.\7";proto=https',
        "for=203.0.113.7;;proto=https;",
        'for=1.1.1.1;host="x, for=9.9.9.9", for=203.0.113.7',
    ],
)
def test_forwarded_is_parsed_by_its_grammar(header: str) -> None:
    assert ClientIdentity(trust_hops=1, header="forwarded")(scope(fwd(header))) == "203.0.113.7"


def test_quoted_commas_do_not_move_a_trusted_walk() -> None:
    key = ClientIdentity(trusted_proxies=["10.0.0.0/8"], header="forwarded")
    header = 'for=1.1.1.1, for=10.0.0.9;host="h, for=10.0.0.8, for=2.2.2.2", for=10.0.0.3'
    assert key(scope(fwd(header))) == "1.1.1.1"
    with pytest.raises(ForwardingHeaderError, match="max_header_bytes"):
        ClientIdentity(trust_hops=1, header="forwarded", max_header_bytes=64)(
            scope(fwd('for=1.1.1.1;host="' + "x," * 100 + '"'))
        )


# --- a trusted entry that cannot be read refuses the request -------------------------------


@pytest.mark.parametrize(
    ("header_name", "value", "reason"),
    [
        ("x-forwarded-for", "1.1.1.1, unknown", "not an IP address: 'unknown'"),
        ("x-forwarded-for", "1.1.1.1, _hidden", "not an IP address: '_hidden'"),
        ("x-forwarded-for", "1.1.1.1, ", "not an IP address: ''"),
        ("x-forwarded-for", "", "not an IP address: ''"),
        ("x-forwarded-for", "1.1.1.1, example.com", "not an IP address"),
        ("x-forwarded-for", "1.2.3.4:http", "not an IP address: '1.2.3.4:http'"),
        ("x-forwarded-for", "[2001:db8::1:80", "not an IP address"),
        ("x-forwarded-for", "01.2.3.4", "not an IP address"),
        ("forwarded", "for=1.1.1.1, for=unknown", "not an IP address: 'unknown'"),
        ("forwarded", 'for="_hidden"', "not an IP address: '_hidden'"),
        ("forwarded", "for=1.1.1.1, proto=https", "no for="),
        ("forwarded", "for=1.1.1.1;for=2.2.2.2", "more than one for="),
        ("forwarded", "for=1.1.1.1;secure", "bad parameter: 'secure'"),
        ("forwarded", 'for="1.1.1.1', "malformed quoted string"),
        ("forwarded", 'for="1.1.1.1"x', "malformed quoted string"),
    ],
)
def test_an_unreadable_trusted_entry_raises(header_name: Header, value: str, reason: str) -> None:
    key = ClientIdentity(trust_hops=1, header=header_name)
    with pytest.raises(ForwardingHeaderError) as excinfo:
        key(scope((header_name, value)))
    assert reason in str(excinfo.value)
    assert header_name in str(excinfo.value)


def test_an_unreadable_entry_in_the_trusted_walk_raises() -> None:
    key = ClientIdentity(trusted_proxies=["10.0.0.0/8"])
    with pytest.raises(ForwardingHeaderError, match="hop 2 from the right"):
        key(scope(xff("1.1.1.1, unknown, 10.0.0.2")))


@pytest.mark.parametrize("header_name", ["x-forwarded-for", "forwarded"])
def test_padding_left_of_the_trusted_entries_changes_nothing(header_name: Header) -> None:
    # The attack: a client at 429 pads the header with junk. Only the
    # proxy-appended right end is read, so its key stays its own.
    entry = "for=2.2.2.2" if header_name == "forwarded" else "2.2.2.2"
    key = ClientIdentity(trust_hops=1, header=header_name, max_hops=3, max_header_bytes=64)
    for junk in ["x" * 10_000, "1.1.1.1, " * 1000, "garbage,,,", 'for="unbalanced']:
        assert key(scope((header_name, junk), (header_name, entry))) == "2.2.2.2"
        assert key(scope((header_name, f"{junk}, {entry}"))) == "2.2.2.2"


def test_oversized_trusted_entries_raise() -> None:
    key = ClientIdentity(trust_hops=2, max_header_bytes=15)
    # "1.1.1.1,2.2.2.2" is 15 bytes: exactly at the limit is fine.
    assert key(scope(xff("9" * 5000 + ",1.1.1.1"), xff("2.2.2.2"))) == "1.1.1.1"
    with pytest.raises(ForwardingHeaderError, match="max_header_bytes=15"):
        key(scope(xff("1.1.1.1"), xff("2.2.2.22")))


def test_more_trusted_hops_than_max_hops_raise() -> None:
    key = ClientIdentity(trusted_proxies=["10.0.0.0/8"], max_hops=3)
    assert key(scope(xff("1.1.1.1, 10.0.0.3, 10.0.0.2"))) == "1.1.1.1"
    assert key(scope(xff("10.0.0.4, 10.0.0.3, 10.0.0.2"))) == "10.0.0.4"
    with pytest.raises(ForwardingHeaderError, match="more than max_hops=3"):
        key(scope(xff("1.1.1.1, 10.0.0.4, 10.0.0.3, 10.0.0.2")))


def test_the_message_does_not_echo_a_long_entry() -> None:
    with pytest.raises(ForwardingHeaderError) as excinfo:
        ClientIdentity(trust_hops=1)(scope(xff("x" * 3000)))
    assert len(str(excinfo.value)) < 300


# --- unix-socket proxies and exposure ---------------------------------------------------------


def test_a_unix_socket_proxy_is_trusted_by_name() -> None:
    named = ClientIdentity(trusted_proxies=["unix"])
    assert named(scope(xff("1.2.3.4"), client=None)) == "1.2.3.4"
    assert named(scope(client=None)) == "unknown"
    # An address peer is not the unix socket: its headers mean nothing.
    assert named(scope(xff("1.2.3.4"))) == "10.0.0.1"
    both = ClientIdentity(trusted_proxies=["unix", "10.0.0.0/8"])
    assert both(scope(xff("1.2.3.4, 10.0.0.7"), client=None)) == "1.2.3.4"
    assert ClientIdentity(trusted_proxies=["10.0.0.0/8"])(scope(xff("1.2.3.4"), client=None)) == (
        "unknown"
    )


def test_trust_hops_warns_once_when_reachable_beyond_loopback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = ClientIdentity(trust_hops=1)
    exposed = {**scope(xff("1.2.3.4")), "server": ("192.0.2.10", 8000)}
    assert key(exposed) == "1.2.3.4"
    assert key(exposed) == "1.2.3.4"
    [record] = warnings(caplog)
    assert "trust_hops=1 trusts whoever connects" in record.getMessage()
    assert "192.0.2.10" in record.getMessage()
    caplog.clear()
    for quiet in (
        ClientIdentity(trust_hops=1),
        ClientIdentity(trusted_proxies=["192.0.2.0/24"]),
        ClientIdentity(),
    ):
        quiet({**scope(), "server": ("127.0.0.1", 8000)})
        if quiet is not key:
            quiet({**scope(), "server": ("::1", 8000)})
    ClientIdentity(trusted_proxies=["10.0.0.0/8"])(exposed)
    ClientIdentity()(exposed)
    ClientIdentity(trust_hops=1)({**scope(), "server": ("/run/app.sock", None)})
    assert warnings(caplog) == []


# --- IPv6 grouping --------------------------------------------------------------------------


def test_ipv6_clients_are_keyed_by_their_64_by_default() -> None:
    key = ClientIdentity()
    assert key(scope(client=("2001:db8:1:2:3:4:5:6", 1))) == "2001:db8:1:2::/64"
    assert key(scope(client=("2001:db8:1:2::9", 1))) == "2001:db8:1:2::/64"
    assert key(scope(client=("10.0.0.1", 1))) == "10.0.0.1"
    assert key(scope(client=("::ffff:10.0.0.1", 1))) == "10.0.0.1"
    assert ClientIdentity(ipv6_prefix=128)(scope(client=("2001:db8:1:2::9", 1))) == (
        "2001:db8:1:2::9"
    )
    assert ClientIdentity(ipv6_prefix=48)(scope(client=("2001:db8:1:2::9", 1))) == (
        "2001:db8:1::/48"
    )


def test_nat64_addresses_are_keyed_by_their_ipv4() -> None:
    key = ClientIdentity()
    assert key(scope(client=("64:ff9b::c000:221", 1))) == "192.0.2.33"
    assert key(scope(client=("64:ff9b::192.0.2.34", 1))) == "192.0.2.34"
    assert ClientIdentity(trust_hops=1)(scope(xff("[64:ff9b::c633:6401]:80"))) == "198.51.100.1"


def test_ipv6_grouping_applies_to_forwarded_clients() -> None:
    key = ClientIdentity(trust_hops=1)
    assert key(scope(xff("[2001:db8:aa:bb:1::1]:443"))) == "2001:db8:aa:bb::/64"
    assert key(scope(xff("1.2.3.4"))) == "1.2.3.4"


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"trust_hops": 1, "trusted_proxies": ["10.0.0.0/8"]},
            "set trust_hops or trusted_proxies, not both",
        ),
        ({"trust_hops": -1}, "trust_hops must be >= 0, got -1"),
        (
            {"trusted_proxies": ["10.0.0.0/8", "10.0.0.300"]},
            "trusted_proxies entry '10.0.0.300' is not an IP address or network, or 'unix'",
        ),
        (
            {"trusted_proxies": "10.0.0.0/8"},
            "trusted_proxies must be a sequence of strings, not a string",
        ),
        (
            {"header": "x-real-ip"},
            "header must be 'x-forwarded-for' or 'forwarded', got 'x-real-ip'",
        ),
        ({"max_header_bytes": 0}, "max_header_bytes must be >= 1, got 0"),
        ({"ipv6_prefix": 0}, "ipv6_prefix must be 1-128, got 0"),
        ({"ipv6_prefix": 129}, "ipv6_prefix must be 1-128, got 129"),
        ({"max_hops": 0}, "max_hops must be >= 1, got 0"),
    ],
)
def test_configuration_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        ClientIdentity(**kwargs)
    assert str(excinfo.value) == message
    assert isinstance(excinfo.value, ValueError)


def test_is_immutable() -> None:
    key = ClientIdentity()
    with pytest.raises(AttributeError, match="immutable"):
        key._trust_hops = 5
    with pytest.raises(AttributeError, match="immutable"):
        del key._walks
    assert not hasattr(key, "__dict__")
