"""The pure media-fetch policy: which addresses, host spellings, domains and local paths are refused."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.errors import MediaError
from app.media.url_policy import (
    METADATA_ADDRESSES,
    REFUSED_NETWORKS,
    MediaPolicy,
    address_refusal,
    domain_allowed,
    embedded_ipv4,
    parse_ip_host,
)
from app.settings import Settings

PARAM = "messages[0].content[0].image_url.url"
DEFAULT = MediaPolicy()


def refusal_code(url: str, policy: MediaPolicy = DEFAULT) -> str | None:
    """The code a literal-host URL is refused with (no DNS involved), None when it passes."""
    try:
        target = policy.check_url(url, param=PARAM)
        if target.ip is not None:
            policy.check_addresses(target, [target.ip], param=PARAM)
    except MediaError as err:
        assert (err.param, err.http_status) == (PARAM, 400)
        return err.code
    return None


# -- addresses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("169.254.1.1", "link-local"),
        ("100.64.0.1", "shared (CGNAT)"),
        ("100.127.255.254", "shared (CGNAT)"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("224.0.0.1", "multicast"),  # is_global says True on Python 3.11
        ("239.255.255.250", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("192.0.0.8", "reserved"),
        ("192.0.2.1", "documentation"),
        ("198.51.100.7", "documentation"),
        ("203.0.113.9", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("169.254.169.254", "cloud metadata"),
        ("169.254.170.2", "cloud metadata"),
        ("100.100.100.200", "cloud metadata"),
        ("168.63.129.16", "cloud metadata"),  # Azure: a public address
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fec0::1", "link-local"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("fd00:ec2::254", "cloud metadata"),
        ("ff02::1", "multicast"),
        ("2001:db8::1", "documentation"),
        ("3fff::1", "documentation"),
        ("100::1", "reserved"),
        ("2001::1", "reserved"),  # Teredo
        ("64:ff9b:1::1", "private"),
        ("::127.0.0.1", "reserved"),  # IPv4-compatible (deprecated); is_global says True on 3.11
        ("::8.8.8.8", "reserved"),
        ("::ffff:10.0.0.1", "private"),  # IPv4-mapped
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::10.0.0.1", "private"),  # NAT64
        ("64:ff9b::7f00:1", "loopback"),
        ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
        ("2002:a00:1::", "private"),
        ("fe80::1%eth0", "link-local"),
    ],
)
def test_refused_addresses(address: str, reason: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "1.1.1.1",
        "93.184.215.14",
        "100.128.0.1",  # just past CGNAT
        "172.32.0.1",  # just past 172.16/12
        "2606:4700:4700::1111",
        "2001:4860:4860::8888",
        "::ffff:8.8.8.8",
        "64:ff9b::8.8.8.8",
        "2002:808:808::1",
    ],
)
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


# -- host spellings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "2130706433",
        "0x7f000001",
        "0X7F000001",
        "0177.0.0.1",
        "0177.0000.0000.0001",
        "127.1",
        "127.0.1",
        "0x7f.1",
        "0x7f.0.0.0x1",
        "017700000001",
        "127.0.0.1.",
    ],
)
def test_odd_ipv4_spellings_read_as_a_resolver_reads_them(host: str) -> None:
    assert parse_ip_host(host) == ipaddress.IPv4Address("127.0.0.1")
    assert refusal_code(f"http://{host}:8080/x.png") == "image_url_forbidden"


@pytest.mark.parametrize("host", ["256.0.0.1", "1.2.3.4.5", "08.0.0.1", "0x100.0.0.1", "4294967296", "a.1"])
def test_numeric_hosts_that_are_no_address_are_invalid(host: str) -> None:
    with pytest.raises(ValueError):
        parse_ip_host(host)
    assert refusal_code(f"http://{host}/x.png") == "invalid_image_url"


@pytest.mark.parametrize("host", ["example.com", "1x.example", "0x7f.example", "localhost"])
def test_names_are_not_addresses(host: str) -> None:
    assert parse_ip_host(host) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x.png",
        "https://[::1]/x.png",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:7f00:1]/",
        "http://[0:0:0:0:0:ffff:a00:1]/",
        "http://2130706433/",
        "http://%31%32%37.0.0.1/",  # percent-encoded host
        "http://user:pw@127.0.0.1/",
        "HTTP://127.0.0.1/",
        "http://0.0.0.0:8000/",
        "http://169.254.169.254/latest/meta-data/",
    ],
)
def test_loopback_and_friends_are_refused_in_any_url_form(url: str) -> None:
    assert refusal_code(url) == "image_url_forbidden"


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("ftp://example.com/x.png", "image_url_forbidden"),
        ("file:///etc/passwd", "image_url_forbidden"),
        ("gopher://example.com/", "image_url_forbidden"),
        ("http:///x.png", "invalid_image_url"),
        ("http://exa mple.com/", "invalid_image_url"),
        ("http://example.com:99999/", "invalid_image_url"),
        ("http://[::1/", "invalid_image_url"),
    ],
)
def test_schemes_and_malformed_urls(url: str, code: str) -> None:
    assert refusal_code(url) == code


def test_allow_private_turns_the_address_checks_off_only() -> None:
    policy = MediaPolicy(allow_private_addresses=True)
    assert refusal_code("http://127.0.0.1/x.png", policy) is None
    assert refusal_code("http://0x7f000001/x.png", policy) is None
    assert refusal_code("ftp://127.0.0.1/x.png", policy) == "image_url_forbidden"


def test_the_message_names_the_rule_and_the_flag_but_not_a_resolved_address() -> None:
    target = DEFAULT.check_url("http://evil.test/x.png", param=PARAM)
    with pytest.raises(MediaError) as info:
        DEFAULT.check_addresses(target, [ipaddress.ip_address("10.1.2.3")], param=PARAM)
    message = info.value.message
    assert "private" in message and "--allow-private-media-urls" in message and "evil.test" in message
    assert "10.1.2.3" not in message


def test_target_addresses_the_validated_ip_and_keeps_the_name() -> None:
    target = DEFAULT.check_url("https://Images.Example.com:8443/a/b.png?x=1#frag", param=PARAM)
    assert (target.scheme, target.host, target.port, target.ip) == ("https", "images.example.com", 8443, None)
    assert target.host_header == "images.example.com:8443"
    assert target.url_to(ipaddress.ip_address("93.184.215.14")) == "https://93.184.215.14:8443/a/b.png?x=1"
    assert target.url_to(ipaddress.ip_address("2606::1")) == "https://[2606::1]:8443/a/b.png?x=1"
    assert DEFAULT.check_url("http://example.com", param=PARAM).host_header == "example.com"
    assert DEFAULT.check_url("http://[2606::1]:81/", param=PARAM).host_header == "[2606::1]:81"
    assert DEFAULT.check_url("http://bücher.de/", param=PARAM).host == "xn--bcher-kva.de"


# -- domain allow-list -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("example.com", True),
        ("cdn.example.com", True),
        ("a.b.example.com", True),
        ("EXAMPLE.com.", True),
        ("images.org", True),
        ("evil-example.com", False),
        ("notexample.com", False),
        ("example.com.evil.org", False),
        ("example.co", False),
        ("com", False),
        ("xexample.com", False),
    ],
)
def test_domain_allow_list(host: str, allowed: bool) -> None:
    assert domain_allowed(host, ("example.com", "images.org")) is allowed
    policy = MediaPolicy(allowed_domains=("example.com", "images.org"))
    assert refusal_code(f"https://{host}/x.png", policy) == (None if allowed else "image_url_forbidden")


def test_domain_allow_list_refuses_address_literals_and_comes_from_settings() -> None:
    settings = Settings(allowed_media_domains="Example.com, bücher.de.", allow_private_media_urls=True)
    policy = MediaPolicy.from_settings(settings)
    assert policy.allowed_domains == ("example.com", "xn--bcher-kva.de")
    assert policy.allow_private_addresses
    assert refusal_code("http://93.184.215.14/x.png", policy) == "image_url_forbidden"
    assert refusal_code("http://BÜCHER.de/x.png", policy) is None
    defaults = MediaPolicy.from_settings(Settings())
    assert defaults.allowed_domains is None and defaults.local_media_root is None
    assert not defaults.allow_private_addresses and defaults.max_redirects == 5


@given(st.from_regex(r"[a-z0-9-]{1,20}", fullmatch=True), st.sampled_from(["example.com", "a.org"]))
def test_subdomains_pass_and_glued_lookalikes_do_not(label: str, domain: str) -> None:
    assert domain_allowed(f"{label}.{domain}", (domain,))
    assert not domain_allowed(f"{label}{domain}", (domain,))
    assert not domain_allowed(f"{domain}.{label}", (domain,))


# -- local files -------------------------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(b"a")
    (root / "sub" / "b.png").write_bytes(b"b")
    (tmp_path / "secret.png").write_bytes(b"secret")
    (root / "link-out.png").symlink_to(tmp_path / "secret.png")
    (root / "link-in.png").symlink_to(root / "sub" / "b.png")
    (root / "dir-out").symlink_to(tmp_path)
    return root


def local_code(url: str, policy: MediaPolicy) -> str | Path:
    try:
        return policy.local_file(url, param=PARAM)
    except MediaError as err:
        return str(err.code)


def test_local_files_inside_the_folder_are_accepted(media_root: Path) -> None:
    policy = MediaPolicy(local_media_root=media_root.resolve())
    assert local_code(f"file://{media_root}/a.png", policy) == media_root / "a.png"
    assert local_code(f"file://localhost{media_root}/sub/b.png", policy) == media_root / "sub" / "b.png"
    assert local_code(f"file://{media_root}/sub/../a.png", policy) == media_root / "a.png"
    assert local_code(f"file://{media_root}/link-in.png", policy) == media_root / "sub" / "b.png"
    assert local_code(f"file://{media_root}/sub/%62.png", policy) == media_root / "sub" / "b.png"


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.png",
        "/sub/../../secret.png",
        "/%2e%2e/secret.png",
        "/link-out.png",
        "/dir-out/secret.png",
        "/dir-out/images/a.png/..",  # a directory in the end
        "",  # the folder itself
        "/../missing.png",  # outside and missing: refused, not "not found"
    ],
)
def test_local_paths_escaping_the_folder_are_refused(media_root: Path, path: str) -> None:
    policy = MediaPolicy(local_media_root=media_root.resolve())
    assert local_code(f"file://{media_root}{path}", policy) == "image_url_forbidden"


def test_local_file_edge_cases(media_root: Path, tmp_path: Path) -> None:
    policy = MediaPolicy(local_media_root=media_root.resolve())
    assert local_code(f"file://{media_root}/missing.png", policy) == "image_fetch_failed"
    assert local_code(f"file://{media_root}/sub", policy) == "image_url_forbidden"
    assert local_code(f"file://otherhost{media_root}/a.png", policy) == "invalid_image_url"
    assert local_code(f"file://{media_root}/a%00.png", policy) == "invalid_image_url"
    assert local_code(f"file://{media_root}/a.png", MediaPolicy()) == "image_url_forbidden"
    # A root named through a symlink is the real folder.
    (tmp_path / "root-link").symlink_to(media_root)
    settings = Settings(allowed_local_media_path=str(tmp_path / "root-link"))
    linked = MediaPolicy.from_settings(settings)
    assert linked.local_media_root == media_root.resolve()
    assert local_code(f"file://{tmp_path}/root-link/a.png", linked) == media_root / "a.png"
    if hasattr(os, "mkfifo"):
        os.mkfifo(media_root / "pipe.png")
        assert local_code(f"file://{media_root}/pipe.png", policy) == "image_url_forbidden"


# -- properties --------------------------------------------------------------------------------------

REFUSED_V4 = [net for net, _ in REFUSED_NETWORKS if net.version == 4]


@st.composite
def refused_ipv4(draw: st.DrawFn) -> ipaddress.IPv4Address:
    net = draw(st.sampled_from(REFUSED_V4))
    return ipaddress.IPv4Address(draw(st.integers(int(net.network_address), int(net.broadcast_address))))


def spell(ip: ipaddress.IPv4Address, style: str) -> str:
    """``ip`` written as a resolver still reads it."""
    value, octets = int(ip), ip.packed
    return {
        "dotted": str(ip),
        "decimal": str(value),
        "hex": hex(value),
        "octal": ".".join(f"0{b:o}" for b in octets),
        "hex-dotted": ".".join(hex(b) for b in octets),
        "short-3": f"{octets[0]}.{octets[1]}.{value & 0xFFFF}",
        "short-2": f"{octets[0]}.{value & 0xFFFFFF}",
        "trailing-dot": f"{ip}.",
    }[style]


SPELLINGS = ["dotted", "decimal", "hex", "octal", "hex-dotted", "short-3", "short-2", "trailing-dot"]


@given(refused_ipv4(), st.sampled_from(SPELLINGS))
def test_a_refused_ipv4_is_refused_in_every_spelling(ip: ipaddress.IPv4Address, style: str) -> None:
    assert address_refusal(ip) is not None
    assert parse_ip_host(spell(ip, style)) == ip
    assert refusal_code(f"http://{spell(ip, style)}/x.png") == "image_url_forbidden"


@given(refused_ipv4(), st.sampled_from(["::ffff:{}", "64:ff9b::{}"]))
def test_a_refused_ipv4_is_refused_inside_ipv6(ip: ipaddress.IPv4Address, form: str) -> None:
    mapped = ipaddress.IPv6Address(form.format(ip))
    six_to_four = ipaddress.IPv6Address((0x2002 << 112) | (int(ip) << 80) | 1)
    for wrapped in (mapped, six_to_four):
        assert embedded_ipv4(wrapped) == ip
        assert address_refusal(wrapped) == address_refusal(ip)
    assert refusal_code(f"http://[{mapped}]/x.png") == "image_url_forbidden"


def in_refused_network(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return any(ip.version == net.version and ip in net for net, _ in REFUSED_NETWORKS)


@given(st.ip_addresses())
def test_a_global_address_outside_the_extra_sets_is_allowed(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    embeds = isinstance(ip, ipaddress.IPv6Address) and embedded_ipv4(ip) is not None
    if embeds:
        assert isinstance(ip, ipaddress.IPv6Address)
        inner = embedded_ipv4(ip)
        assert inner is not None and address_refusal(ip) == address_refusal(inner)
    elif ip.is_global and not in_refused_network(ip) and ip not in METADATA_ADDRESSES:
        assert address_refusal(ip) is None
    else:
        assert address_refusal(ip) is not None  # nothing non-global ever passes
