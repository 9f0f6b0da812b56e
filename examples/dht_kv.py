"""Two DHT peers in one script: the smallest use of the dht package.

    python examples/dht_kv.py                      # starts its own two-peer swarm
    python examples/dht_kv.py --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...

Shows a plain record, a sub-key dictionary (how peers announce themselves for matchmaking), and an
owned sub-key that only its writer can change.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from dht import DHTNode, InvalidRecord, Multiaddr


async def main(bootstrap: list[Multiaddr]) -> None:
    first = None
    if not bootstrap:
        first = DHTNode()
        await first.start()
        bootstrap = [first.multiaddrs[0]]
        print("started a bootstrap peer at", bootstrap[0])
    alice, bob = DHTNode(), DHTNode(listen=None)  # bob runs in client mode (no inbound connections)
    await asyncio.gather(alice.start(bootstrap), bob.start(bootstrap))
    try:
        now = time.time()
        await alice.store("demo/config", {"lr": 3e-4, "batch": 32}, now + 60)
        print("bob reads demo/config:", (await bob.get("demo/config")).value)

        for node, name in ((alice, "alice"), (bob, "bob")):
            await node.store("demo/members", {"name": name}, now + 30, subkey=node.owned("member"))
        members = await alice.get("demo/members", latest=True)
        print("members:", sorted(v.value["name"] for v in members.values()))

        try:
            await bob.store("demo/members", {"name": "mallory"}, now + 60, subkey=alice.owned("member"))
        except InvalidRecord as e:
            print("bob cannot overwrite alice's entry:", e)
    finally:
        await asyncio.gather(alice.close(), bob.close())
        if first is not None:
            await first.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", action="append", default=[], help="multiaddr of a running peer")
    asyncio.run(main([Multiaddr.parse(a) for a in parser.parse_args().bootstrap]))
