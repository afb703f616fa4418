"""A TCP relay on loopback that holds every byte for a fixed time each way: the latency of a network between an
agent and its server, for `python bench/transport.py --rtt-ms R` (each direction held R/2 ms).

    python bench/delay_relay.py TARGET_PORT DELAY_S     # prints "PORT n" (the relay's), relays until killed

Bytes keep their order and are never held longer than DELAY_S past their arrival (no bandwidth limit is added: only
what the relay's one thread can copy). The receiving side's own flow control is what the relay makes visible: a
sender may have at most one flow-control window in flight per round trip.
"""
from __future__ import annotations

import asyncio
import sys
import time

READ_BYTES = 1 << 20


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each piece written `delay` seconds after it was read; EOF passed on the same way."""
    held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def take() -> None:
        while True:
            data = await reader.read(READ_BYTES)
            await held.put((time.monotonic() + delay, data))
            if not data:
                return

    async def give() -> None:
        while True:
            due, data = await held.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(take(), give())


async def _serve(target_port: int, delay: float) -> None:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(_pipe(client_r, server_w, delay), _pipe(server_r, client_w, delay),
                             return_exceptions=True)

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    asyncio.run(_serve(int(argv[0]), float(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
