"""The `http.fetch` host operation (`HttpOps`): an inferlet's way out of the sandbox, guarded.

The request runs on the run's host loop (httpx, async), so the inferlet's other tasks and the
actor's other calls go on meanwhile; the guest gets a future of the response. Guards, from the
run's limits:

* Only hosts in `limits.allow_hosts` (`[limits] allow_hosts`, `pie run --allow-host`) are reached;
  none by default. "*" allows any host with public addresses.
* A host whose addresses are not public (loopback, private, link-local, reserved ranges) or are this
  machine's or the Ray cluster's own is refused unless it is named in the list itself (by name or
  by address): "*" never opens them.
* The request connects to the address that was checked (the URL's host goes in the Host header and
  TLS's server name), so a name whose DNS answer changes after the check (rebinding) cannot move
  the request to an address the check would refuse.
* Redirects are followed by hand (at most MAX_REDIRECTS), each target through the same guards.
* `limits.http_timeout_s` bounds a request (the guest may ask for less), and so does the run's
  deadline; a body over `limits.http_response_mb` is cut off and fails the request.

Every refusal or failure fails the guest's future with "KIND: message", KIND one of refused,
timeout, too_large, failed (the SDK raises `http.HttpError` with that kind).
"""
from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
from functools import partial
from typing import Any
from urllib.parse import urljoin, urlsplit

from typing_extensions import NotRequired, TypedDict

from .host import HostOpError
from .host_op import host_op, shape
from .run_state import RunState

__all__ = ["HttpOps", "own_addresses"]

MAX_REDIRECTS = 5
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class _Refused(Exception):
    kind = "refused"


class _TooLarge(Exception):
    kind = "too_large"


def own_addresses() -> set[str]:
    """This machine's addresses and, on a Ray cluster, its nodes' (what a fetch must not reach)."""
    found = set()
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:
        import ray
        if ray.is_initialized():
            found.update(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive"))
    except Exception:    # no Ray, or its GCS unreachable: the private ranges still cover it
        pass
    return found


@shape
class Fetch(TypedDict):
    url: str
    method: NotRequired[str | None]                 # GET by default
    headers: NotRequired[dict[str, str] | None]
    body: NotRequired[str | None]                   # base64
    timeout: NotRequired[float | None]              # seconds, at most limits.http_timeout_s


class HttpOps:
    interface = "http"

    def __init__(self, run: RunState) -> None:
        self.run = run
        self.allowed = {h.lower() for h in run.limits.allow_hosts}
        self._own: set[str] | None = None

    @host_op("http.fetch", Fetch)
    def fetch(self, url: str, method: str | None = None, headers: dict[str, str] | None = None,
              body: str | None = None, timeout: float | None = None) -> int:
        """A future of the response {status, url, headers: [[name, value]], body: base64}."""
        method = (method or "GET").upper()
        if method not in METHODS:
            raise HostOpError(f"refused: http.fetch: method {method!r} is not one of {', '.join(METHODS)}")
        headers = headers or {}
        content = None if body is None else base64.b64decode(body)
        limit = self.run.limits.http_timeout_s
        timeout = self.run.time_left(min(timeout or limit, limit))
        try:
            self._check_listed(url)
        except _Refused as e:
            raise HostOpError(f"refused: {e}") from None
        fid = self.run.futures.new()
        self.run.start_task(self._fetch(fid, method, url, headers, content, timeout))
        return fid

    def _check_listed(self, url: str) -> str:
        """The URL's host, if the allow-list lets it be asked for at all."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _Refused(f"{url!r} is not an http(s) URL")
        host = parts.hostname.lower()
        if not self.allowed:
            raise _Refused(f"http.fetch of {host!r}: no host is allowed (allow hosts in the config's "
                           "[limits] allow_hosts, or for one run with pie run --allow-host HOST)")
        if host not in self.allowed and "*" not in self.allowed:
            raise _Refused(f"http.fetch of {host!r}: the host is not in [limits] allow_hosts "
                           f"({', '.join(sorted(self.allowed))}; pie run --allow-host HOST adds one)")
        return host

    async def _checked_address(self, url: str) -> str:
        """The address to connect to for `url`: its host's first, once every one it resolves to passes.

        A private or cluster address is refused unless the host is named on the list itself."""
        host = self._check_listed(url)
        port = urlsplit(url).port or (443 if url.lower().startswith("https") else 80)
        loop = asyncio.get_running_loop()
        try:
            # Python's resolver on a worker thread, as asyncio's loop does it: uvloop's getaddrinfo
            # resolves inside libuv, where the process's socket.getaddrinfo (and its hooks) is not asked
            infos = await loop.run_in_executor(None, partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            raise OSError(f"cannot resolve {host!r}: {e}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))     # the resolver's order
        if host in self.allowed or self.allowed.intersection(addresses):
            return addresses[0]                 # named on the list: the user meant this host
        if self._own is None:
            self._own = await loop.run_in_executor(None, own_addresses)
        for address in sorted(addresses):
            ip = ipaddress.ip_address(address.split("%")[0])
            if not ip.is_global or address in self._own:
                raise _Refused(f"http.fetch of {host!r}: it resolves to {address}, a private or this "
                               "cluster's own address; name the host itself in [limits] allow_hosts "
                               "to reach it")
        return addresses[0]

    async def _fetch(self, fid: int, method: str, url: str, headers: dict[str, str], body: bytes | None,
                     timeout: float) -> None:
        try:
            response = await asyncio.wait_for(self._follow(method, url, headers, body), timeout)
        except asyncio.TimeoutError:
            self.run.complete(fid, error=f"timeout: http.fetch of {url!r} took longer than {timeout:.3g} s")
        except (_Refused, _TooLarge) as e:
            self.run.complete(fid, error=f"{e.kind}: {e}")
        except Exception as e:        # httpx's errors, a host that does not resolve
            self.run.complete(fid, error=f"failed: http.fetch of {url!r}: {type(e).__name__}: {e}")
        else:
            self.run.complete(fid, response)

    async def _follow(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> dict[str, Any]:
        import httpx

        headers = {k: v for k, v in headers.items() if k.lower() != "host"}
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                target = httpx.URL(url)
                request = client.build_request(
                    method, target.copy_with(host=await self._checked_address(url)), content=body,
                    headers={**headers, "host": target.netloc.decode("ascii")},
                    extensions={"sni_hostname": target.raw_host.decode("ascii")})
                response = await client.send(request, stream=True)
                try:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        if response.status_code in (301, 302, 303) and method != "HEAD":
                            method, body = "GET", None
                        continue
                    return {"status": response.status_code, "url": url,
                            "headers": [[k, v] for k, v in response.headers.multi_items()],
                            "body": base64.b64encode(await self._read(response, url)).decode("ascii")}
                finally:
                    await response.aclose()
            raise OSError(f"more than {MAX_REDIRECTS} redirects")

    async def _read(self, response: Any, url: str) -> bytes:
        limit = self.run.limits.http_response_mb << 20
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():     # decoded: a compressed bomb counts whole
            size += len(chunk)
            if size > limit:
                raise _TooLarge(f"http.fetch of {url!r}: the response is larger than "
                                f"{self.run.limits.http_response_mb} MiB ([limits] http_response_mb)")
            chunks.append(chunk)
        return b"".join(chunks)
