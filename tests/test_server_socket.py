"""The serving socket of `xserv-aot serve` (xserv_aot/server/run.bind_socket): Nagle off on every connection."""
from __future__ import annotations

import asyncio
import socket

from xserv_aot.server.run import bind_socket


def test_accepted_connections_have_nagle_off():
    """asyncio (as uvicorn serves a given socket: loop.create_server(sock=...)) sets TCP_NODELAY only on accepted
    sockets whose protocol is IPPROTO_TCP. A listening socket made with protocol 0 left Nagle on, and a client's
    delayed ACK then held the second write of a response (the body after the headers, the first SSE chunk) 40 ms on
    every request of a kept-alive connection after its first."""
    sock = bind_socket("127.0.0.1", 0)

    async def nodelay_of_accepted() -> int:
        loop = asyncio.get_running_loop()
        seen = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 30)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(nodelay_of_accepted()) != 0
