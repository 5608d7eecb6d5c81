"""PeerClients: one client per live member over a changing member set."""

from __future__ import annotations

from tierstore.peer.clients import KEPT_CLIENTS, PeerClients


class FakeClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    def close(self) -> None:
        self.closed = True


class ChangingMembers:
    def __init__(self, addresses: list[str]) -> None:
        self.version = 0
        self._addresses = addresses

    def set(self, addresses: list[str]) -> None:
        self._addresses = addresses
        self.version += 1

    def addresses(self) -> list[str]:
        return list(self._addresses)

    def close(self) -> None:
        pass


def test_peer_clients_follow_the_set_and_keep_returning_members() -> None:
    members = ChangingMembers(["me:1", "a:1", "b:1"])
    made: list[FakeClient] = []

    def make(addr: str) -> FakeClient:
        made.append(FakeClient(addr))
        return made[-1]

    clients = PeerClients(members, make, exclude="me:1")  # type: ignore[arg-type]
    first = clients.clients()
    assert sorted(first) == ["a:1", "b:1"]
    assert clients.clients() is first  # unchanged set: no rebuild
    members.set(["me:1", "b:1", "c:1"])
    assert sorted(clients.clients()) == ["b:1", "c:1"]
    members.set(["me:1", "a:1", "b:1", "c:1"])
    again = clients.clients()
    assert again["a:1"] is first["a:1"]  # the returning member keeps its client
    assert len(made) == 3 and not any(c.closed for c in made)
    clients.close()
    assert all(c.closed for c in made)


def test_peer_clients_close_long_departed_members_beyond_the_bound() -> None:
    members = ChangingMembers([])
    made: dict[str, FakeClient] = {}

    def make(addr: str) -> FakeClient:
        made[addr] = FakeClient(addr)
        return made[addr]

    clients = PeerClients(members, make)  # type: ignore[arg-type]
    n = KEPT_CLIENTS + 10
    for i in range(n):
        members.set([f"h{i}:1"])
        clients.clients()
    closed = [a for a, c in made.items() if c.closed]
    assert closed == [f"h{i}:1" for i in range(10)]  # the longest gone, first
    assert not made[f"h{n - 1}:1"].closed
