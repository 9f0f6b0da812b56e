"""Request/response calls over a connection: our calls awaiting replies, the peer's requests run
as handler tasks (cancelled when the peer sends CANCEL or the connection dies).

``RPCEndpoint`` is a part of ``connection.Connection``, which feeds it the REQUEST, RESPONSE, ERROR
and CANCEL frames and sends what it posts. Requests are untrusted input: a malformed one raises
ProtocolError (the connection closes), a handler's error goes back to the caller as a reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Awaitable, Callable

from .errors import DHTError, ProtocolError, RPCError, RPCTimeout
from .identity import PeerID
from .mux import Mux
from .wire import MAX_MESSAGE, Kind, pack, unpack

log = logging.getLogger("dht.transport")

#: serves one method: ``handler(connection, args) -> reply`` (any msgpack-able value)
RequestHandler = Callable[[Any, Any], Awaitable[Any]]


class RPCEndpoint:
    """Calls and request handling of ``Connection``."""

    host: Any  # transport.Host: its loop, limits and request handlers
    remote_peer: PeerID | None
    _mux: Mux
    _calls: dict[int, asyncio.Future]
    _serving: dict[int, asyncio.Task]
    send_frame: Callable[..., None]
    post: Callable[..., None]
    _spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task]

    async def call(self, method: str, args: Any = None, timeout: float = 5.0) -> Any:
        """Call ``method`` on the remote peer; raises RPCTimeout, RPCError or PeerUnreachable."""
        ident = self._mux.new_id()
        fut = self.host.loop.create_future()
        self._calls[ident] = fut
        try:
            self.send_frame(Kind.REQUEST, ident, pack([method, args]))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self._cancel_remote(ident)
            raise RPCTimeout(f"{method} to {self.remote_peer} timed out after {timeout} s") from None
        except asyncio.CancelledError:
            self._cancel_remote(ident)
            raise
        finally:
            self._calls.pop(ident, None)

    def _cancel_remote(self, ident: int) -> None:
        self.post(Kind.CANCEL, ident)

    def _on_request(self, ident: int, body: memoryview) -> None:
        if ident in self._serving:
            raise ProtocolError("request id reused while in flight")
        msg = unpack(body)
        if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], str)):
            raise ProtocolError("malformed request")
        method, args = msg
        if len(self._serving) >= self.host.limits.max_concurrent_requests:
            self.post(Kind.ERROR, ident, pack("busy: too many concurrent requests"))
            return
        handler = self.host._handlers.get(method)
        if handler is None:
            self.post(Kind.ERROR, ident, pack(f"unknown method {method!r}"))
            return
        task = self._spawn(self._serve(ident, method, handler, args))
        self._serving[ident] = task

    async def _serve(self, ident: int, method: str, handler: RequestHandler, args: Any) -> None:
        try:
            result = await handler(self, args)
            body = pack(result)
            if len(body) > MAX_MESSAGE:  # the peer would drop the connection over such a frame
                log.warning("handler %s replied with %d bytes, over the %d-byte message limit", method,
                            len(body), MAX_MESSAGE)
                body = pack(f"{method}: reply of {len(body)} bytes exceeds the {MAX_MESSAGE}-byte message limit")
                self.post(Kind.ERROR, ident, body)
                return
            self.post(Kind.RESPONSE, ident, body)
        except asyncio.CancelledError:
            pass
        except (DHTError, ValueError, TypeError, KeyError) as e:
            # Includes schema errors from validating the peer's arguments: report, do not crash.
            self.post(Kind.ERROR, ident, pack(f"{method}: {e}"[:500]))
        except Exception:
            log.exception("handler %s failed", method)
            self.post(Kind.ERROR, ident, pack(f"{method}: internal error"))
        finally:
            self._serving.pop(ident, None)

    def _on_reply(self, kind: Kind, ident: int, body: memoryview) -> None:
        fut = self._calls.get(ident)
        if fut is not None and not fut.done():
            if kind == Kind.RESPONSE:
                fut.set_result(unpack(body))
            else:
                reason = unpack(body)
                fut.set_exception(RPCError(f"{self.remote_peer}: {reason if isinstance(reason, str) else 'error'}"))

    def _on_cancel(self, ident: int) -> None:
        task = self._serving.get(ident)
        if task is not None:
            task.cancel()
