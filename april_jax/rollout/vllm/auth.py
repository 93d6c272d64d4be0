"""Key on every route of the vLLM server (`--middleware april_jax.rollout.vllm.auth.RequireKey`).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere: with VLLM_SERVER_DEV_MODE the
control routes (/collective_rpc, /reset_prefix_cache, /abort_requests, /pause, /sleep, ...) answer
anyone who can reach the port. This pure-ASGI middleware wraps the whole app and refuses every
request without `Authorization: Bearer <VLLM_API_KEY>`, except `GET /health` (liveness only; it
runs nothing). The key comes from the environment, not argv: /proc/PID/cmdline is world-readable,
/proc/PID/environ is the owner's. A server started without a key refuses everything (fail closed).

Runs in the vLLM interpreter: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os

KEY_ENV = "VLLM_API_KEY"
OPEN_ROUTES = {("GET", "/health")}


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class RequireKey:
    def __init__(self, app):
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._key_digest = _digest(key) if key else None

    def allowed(self, scope) -> bool:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in OPEN_ROUTES:
            return True
        if self._key_digest is None:
            return False
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        # compare digests: constant time and independent of the token's length
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._key_digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = b'{"error": "Unauthorized: this server needs Authorization: Bearer <key> on every route"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
