"""Admission and graceful shutdown: which generations are in flight, and draining them.

drain(grace): stop admitting (new generation requests get 503, /health says draining), wait up to `grace` seconds
for the generations in flight to finish, then abort the rest through the engine so each still ends with a final
output (finish_reason "abort": a last chunk + [DONE] for streams), and wait up to `flush` seconds for them to go.
cut_grace() ends the grace period early (a second SIGTERM).
"""
from __future__ import annotations

import asyncio
import logging
import time

from xserv_aot.server.protocol import RequestError

log = logging.getLogger(__name__)


class Admission:
    def __init__(self):
        self.draining = False
        self.stopping = asyncio.Event()              # set when the drain begins: body reads in progress end
        self.live: set = set()                       # streaming.Generation objects not yet closed
        self._grace_cut = False

    def check(self) -> None:
        if self.draining:
            raise RequestError("the server is shutting down; retry on another replica", status=503,
                               code="server_shutting_down")

    async def guard(self, read):
        """Await `read` (a request body read) unless a drain begins first: then 503 at once (the request could
        not be admitted after its body anyway)."""
        task, stop = asyncio.ensure_future(read), asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            self.check()
        return task.result()

    def cut_grace(self) -> None:
        self._grace_cut = True

    async def _wait_empty(self, seconds: float, cuttable: bool = False) -> bool:
        deadline = time.monotonic() + seconds
        while self.live and time.monotonic() < deadline and not (cuttable and self._grace_cut):
            await asyncio.sleep(0.02)
        return not self.live

    async def drain(self, grace: float, flush: float = 5.0) -> None:
        self.draining = True
        self.stopping.set()
        log.info("draining: %d generation(s) in flight, grace %.1f s", len(self.live), grace)
        if await self._wait_empty(grace, cuttable=True):
            return
        log.warning("aborting %d generation(s) still running after the shutdown grace", len(self.live))
        for gen in list(self.live):
            gen.abort()
        if not await self._wait_empty(flush):
            log.error("%d generation(s) did not end within %.1f s of their abort", len(self.live), flush)
