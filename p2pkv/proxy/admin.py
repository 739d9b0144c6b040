"""Who may use the proxy's admin routes: those that steer the cluster (pause, resume, cache resets, methods run on
every worker) or say what it is made of (its instances and metrics).

With an admin key (`P2PKV_PROXY_ADMIN_KEY`), they need `Authorization: Bearer <admin key>`, from anywhere; the
clients' key (`P2PKV_PROXY_API_KEY`) never opens them. Without one, they answer clients on loopback only. What the
proxy sends the instances for them carries the clients' key, which the instances share, never the admin key."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import Response

from p2pkv.hostaddr import is_loopback
from p2pkv.proxy.upstream import error_response

ADMIN_KEY_ENV = "P2PKV_PROXY_ADMIN_KEY"
API_KEY_ENV = "P2PKV_PROXY_API_KEY"


def bearer_is(request: Request, key: str) -> bool:
    """Whether the request carries `Authorization: Bearer <key>`, compared in constant time."""
    given = request.headers.get("authorization", "").encode()
    return hmac.compare_digest(given, f"Bearer {key}".encode())


def admin_refusal(request: Request, admin_key: str) -> Response | None:
    """The answer that refuses this request to an admin route; None if it may go on."""
    if admin_key:
        if bearer_is(request, admin_key):
            return None
        return error_response(401, f"admin routes need Authorization: Bearer <{ADMIN_KEY_ENV}>",
                              "authentication_error")
    if request.client is not None and is_loopback(request.client.host):
        return None
    return error_response(403, f"admin routes answer clients beyond loopback only with an admin key: set "
                          f"{ADMIN_KEY_ENV} on the proxy and send Authorization: Bearer <that key>",
                          "permission_error")


def instance_headers(api_key: str) -> dict[str, str]:
    """The headers of the proxy's own requests to instances (controls, probes): the clients' key they share."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}
