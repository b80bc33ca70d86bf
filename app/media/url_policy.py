"""Which image URLs the server may fetch: the pure half of the media-fetch policy (no network).

``MediaPolicy.check_url`` parses one URL (the request's, or a redirect's) into a ``Target`` and refuses
what the policy forbids before anything is resolved; ``check_addresses`` refuses a target whose host
resolved to ANY non-public address; ``local_file`` maps an allowed ``file://`` URL to a real path inside
the allowed folder. The fetcher (``app.media.fetch``) calls them on every hop and connects only to an
address that passed. Refusals are ``MediaError``s with code ``image_url_forbidden`` (the rule, and the
flag that would allow it) or ``invalid_image_url`` (not a URL that can be fetched at all).

Host spellings are read as a resolver (and the WHATWG URL standard) reads them: ``2130706433``,
``0x7f000001``, ``0177.0.0.1`` and ``127.1`` all name 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from app.errors import MediaError
from app.media.kinds import MediaKind

if TYPE_CHECKING:
    from app.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

ALLOW_PRIVATE_FLAG = "--allow-private-media-urls"
DOMAINS_FLAG = "--allowed-media-domains"
LOCAL_PATH_FLAG = "--allowed-local-media-path"
DEFAULT_PORTS = {"http": 80, "https": 443}

# Cloud instance-metadata endpoints; most lie in ranges refused anyway, Azure's wire server does not.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure IMDS, OpenStack, Oracle, DigitalOcean
        "169.254.170.2",  # AWS ECS task metadata
        "168.63.129.16",  # Azure wire server (a public address)
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud (legacy)
        "fd00:ec2::254",  # AWS IMDS over IPv6
    )
)

# Refused whatever Python's ``is_global`` says (its tables differ between patch releases and miss some:
# multicast and ::/8 count as global in 3.11); the first network holding an address names the reason.
# Everything else must also be ``is_global``.
REFUSED_NETWORKS: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.ip_network(net), reason)
    for net, reason in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared (CGNAT)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "reserved"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "reserved"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),  # includes the broadcast address
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "private"),  # local-use NAT64
        ("100::/64", "reserved"),  # discard-only
        ("2001::/23", "reserved"),  # IETF protocol assignments, Teredo included
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "reserved"),  # SRv6 SIDs
        ("fc00::/7", "private"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "link-local"),  # deprecated site-local
        ("ff00::/8", "multicast"),
        ("::/8", "reserved"),  # after 64:ff9b:1::/48 (first match names the reason); ::a.b.c.d too
    )
)
_IPV4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")

_HOSTNAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_IPV4_PART = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")


def parse_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in any spelling a resolver accepts (WHATWG URL host parsing): 1 to 4 parts, each
    decimal, ``0x`` hex or ``0``-led octal, the last filling the remaining bytes. None when the last
    label is not a number (a domain name); ``ValueError`` when it is, but the whole is no address."""
    parts = host.split(".")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # "127.0.0.1." is 127.0.0.1
    if not _IPV4_PART.fullmatch(parts[-1]):
        return None
    if len(parts) > 4:
        raise ValueError(f"too many parts in IPv4 address {host!r}")
    numbers = []
    for part in parts:
        if not _IPV4_PART.fullmatch(part):
            raise ValueError(f"not an IPv4 address: {host!r}")
        if part[:2].lower() == "0x":
            numbers.append(int(part[2:] or "0", 16))
        elif len(part) > 1 and part[0] == "0":
            numbers.append(int(part, 8))  # ValueError for 8 and 9, as a resolver refuses them
        else:
            numbers.append(int(part))
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (5 - len(numbers)):
        raise ValueError(f"IPv4 address out of range: {host!r}")
    value = last
    for i, n in enumerate(leading):
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def parse_ip_host(host: str) -> IPAddress | None:
    """The address a URL host names literally (IPv6 without brackets, IPv4 in any spelling), or None
    for a domain name. ``ValueError`` for a host that is neither."""
    if ":" in host:
        return ipaddress.IPv6Address(host.split("%", 1)[0])  # a zone id changes no classification
    return parse_ipv4(host)


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches: IPv4-mapped, NAT64 (64:ff9b::/96) or 6to4."""
    if ip in _IPV4_MAPPED:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _6TO4:
        return ip.sixtofour
    return None


def address_refusal(ip: IPAddress) -> str | None:
    """Why fetching from ``ip`` is refused ("loopback", "private", "cloud metadata", ...), None if the
    address is public. An IPv6 address that embeds an IPv4 address is judged by that address."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ipaddress.IPv6Address(int(ip))  # drop a zone id
        inner = embedded_ipv4(ip)
        if inner is not None:
            return address_refusal(inner)
    if ip in METADATA_ADDRESSES:
        return "cloud metadata"
    for network, reason in REFUSED_NETWORKS:
        if ip.version == network.version and ip in network:
            return reason
    return None if ip.is_global else "non-public"


def domain_allowed(host: str, allowed_domains: tuple[str, ...]) -> bool:
    """``host`` is one of ``allowed_domains`` or a subdomain of one (``cdn.example.com`` for
    ``example.com``; never ``evil-example.com`` or ``example.com.evil.org``)."""
    host = host.lower().rstrip(".")
    return any(host == domain or host.endswith("." + domain) for domain in allowed_domains)


def path_inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass(frozen=True)
class Target:
    """One http(s) URL as the fetcher addresses it."""

    scheme: str
    host: str  # lower-case IDNA name, or the address's canonical text
    port: int
    ip: IPAddress | None  # the address a literal host names; None for a domain name
    path: str  # path and query, as sent
    userinfo: str  # "user:password@" or ""

    @property
    def host_header(self) -> str:
        """``Host`` as the URL names it (port only when not the scheme's default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    def url_to(self, ip: IPAddress) -> str:
        """This URL with its host replaced by ``ip``: where the connection goes."""
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        return f"{self.scheme}://{self.userinfo}{host}:{self.port}{self.path}"


@dataclass(frozen=True)
class MediaPolicy:
    """What media URLs may reach; built once from ``Settings`` at start and never changed."""

    allow_private_addresses: bool = False
    allowed_domains: tuple[str, ...] | None = None  # lower-case; None: any host
    local_media_root: Path | None = None  # file:// refused when None
    max_redirects: int = 5
    timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20
    max_request_image_bytes: int = 64 << 20
    max_video_bytes: int = 256 << 20

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaPolicy:
        domains = settings.allowed_media_domains
        root = settings.allowed_local_media_path
        return cls(
            allow_private_addresses=settings.allow_private_media_urls,
            allowed_domains=None if domains is None else tuple(_idna(d) for d in domains),
            local_media_root=None if root is None else Path(root).resolve(),
            max_redirects=settings.max_media_redirects,
            timeout_s=settings.fetch_timeout_s,
            max_image_bytes=settings.max_image_bytes,
            max_request_image_bytes=settings.max_request_image_bytes,
            max_video_bytes=settings.max_video_bytes,
        )

    def max_bytes(self, kind: MediaKind) -> int:
        """Encoded bytes one item of ``kind`` may have."""
        return self.max_video_bytes if kind is MediaKind.VIDEO else self.max_image_bytes

    def check_url(self, url: str, *, param: str, kind: MediaKind = MediaKind.IMAGE) -> Target:
        """Parses an http(s) URL and applies the scheme and domain rules (called on every hop, before
        any DNS lookup)."""
        noun = kind.noun
        try:
            parts = urlsplit(url)
            scheme, port = parts.scheme.lower(), parts.port
            raw_host = unquote(parts.hostname or "")
        except ValueError as exc:
            raise MediaError(
                f"{noun} URL {url!r} is malformed: {exc}.", param=param, code=kind.invalid_url_code
            ) from exc
        if scheme not in DEFAULT_PORTS:
            raise forbidden(f"{noun} URL {url!r} refused: only http(s) URLs are fetched.", param, kind)
        try:
            ip = parse_ip_host(raw_host)
            host = str(ip) if ip is not None else _idna(raw_host)
        except (ValueError, UnicodeError) as exc:
            raise MediaError(
                f"{noun} URL {url!r} has an invalid host.", param=param, code=kind.invalid_url_code
            ) from exc
        if ip is None and not _HOSTNAME.fullmatch(host):
            raise MediaError(
                f"{noun} URL {url!r} has an invalid host.", param=param, code=kind.invalid_url_code
            )
        if self.allowed_domains is not None and not domain_allowed(host, self.allowed_domains):
            raise forbidden(
                f"{noun} URL {url!r} refused: host {host!r} is not one of the allowed media domains "
                f"or their subdomains ({DOMAINS_FLAG}).",
                param,
                kind,
            )
        userinfo = parts.netloc.rpartition("@")[0]
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return Target(
            scheme, host, port or DEFAULT_PORTS[scheme], ip, path, f"{userinfo}@" if userinfo else ""
        )

    def check_addresses(
        self, target: Target, addresses: list[IPAddress], *, param: str, kind: MediaKind = MediaKind.IMAGE
    ) -> None:
        """Refuses ``target`` when ANY address its host resolved to is not public (no picking of a
        good one: the next answer could be the bad one). The message names the rule, not the address."""
        if self.allow_private_addresses:
            return
        for ip in addresses:
            reason = address_refusal(ip)
            if reason is not None:
                verb = "is" if target.ip is not None else "resolves to"
                raise forbidden(
                    f"{kind.noun} URL host {target.host!r} {verb} a non-public address ({reason}); {kind} "
                    f"URLs must reach public addresses ({ALLOW_PRIVATE_FLAG} allows others, for "
                    "development).",
                    param,
                    kind,
                )

    def local_file(self, url: str, *, param: str, kind: MediaKind = MediaKind.IMAGE) -> Path:
        """The real path of an allowed ``file://`` URL: inside ``local_media_root`` after ``..`` and
        symlinks are resolved, and a regular file. A missing file is ``image_fetch_failed``."""
        if self.local_media_root is None:
            raise forbidden(
                f"file:// {kind} URLs are refused; {LOCAL_PATH_FLAG} DIR accepts files under DIR.",
                param,
                kind,
            )
        parts = urlsplit(url)
        raw_path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not raw_path.startswith("/") or "\0" in raw_path:
            raise MediaError(
                f"file:// {kind} URLs must have the form file:///absolute/path.",
                param=param,
                code=kind.invalid_url_code,
            )
        outside = forbidden(
            f"{kind.noun} file refused: not a file inside the allowed local media folder "
            f"({LOCAL_PATH_FLAG}).",
            param,
            kind,
        )
        # Containment is checked before existence, so nothing outside the folder can be probed.
        if not path_inside(Path(raw_path).resolve(), self.local_media_root):
            raise outside
        try:
            path = Path(raw_path).resolve(strict=True)
        except OSError as exc:
            raise MediaError(
                f"{kind.noun} file not found.", param=param, code=kind.fetch_failed_code
            ) from exc
        if not path_inside(path, self.local_media_root) or not path.is_file():
            raise outside
        return path


def forbidden(message: str, param: str, kind: MediaKind = MediaKind.IMAGE) -> MediaError:
    return MediaError(message, param=param, code=kind.forbidden_code)


def _idna(name: str) -> str:
    """A domain name as DNS and ``Host`` carry it: lower-case ASCII, without a trailing dot."""
    name = name.lower().rstrip(".")
    return name if name.isascii() else name.encode("idna").decode("ascii")
