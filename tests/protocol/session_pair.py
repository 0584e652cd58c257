"""Two sessions joined without sockets (after h11's ConnectionPair)."""

from __future__ import annotations

from collections import deque

from protocol_samples import message_for

from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import TRANSITIONS, Dropped, Message, Session, SessionState, Trigger


def path_to(target: SessionState) -> list[tuple[Role, Trigger]]:
    """The shortest (sender, trigger) sequence from idle to ``target``, found in the table."""
    paths: dict[SessionState, list[tuple[Role, Trigger]]] = {SessionState.IDLE: []}
    queue = deque([SessionState.IDLE])
    while queue:
        state = queue.popleft()
        for (src, role, trigger), dst in TRANSITIONS.items():
            if src is state and dst not in paths:
                paths[dst] = paths[state] + [(role, trigger)]
                queue.append(dst)
    return paths[target]


class SessionPair:
    """A prefill and a decode :class:`Session`; frames go from one to the other."""

    def __init__(self) -> None:
        self.sessions = {role: Session(role) for role in Role}

    def __getitem__(self, role: Role) -> Session:
        return self.sessions[role]

    def peer(self, role: Role) -> Session:
        return self.sessions[Role.DECODE if role is Role.PREFILL else Role.PREFILL]

    @property
    def states(self) -> tuple[SessionState, SessionState]:
        return self[Role.PREFILL].state, self[Role.DECODE].state

    def deliver(self, sender: Role, message: Message) -> Message | Dropped:
        """``sender`` sends ``message``; the other end receives its frame."""
        return self.peer(sender).receive_data(self[sender].send(message))

    def drive_to(self, state: SessionState) -> SessionPair:
        for sender, trigger in path_to(state):
            self.deliver(sender, message_for(trigger, sender))
        assert self.states == (state, state)
        return self
