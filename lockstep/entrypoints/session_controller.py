"""SGLang's sessions (`/open_session`, `/close_session`, a request's `session_params`): a
multi-turn client sends only its new turn, and the request continues an earlier request of the
session, whose prompt and output come first. The continued prompt's KV is the earlier request's,
still in the prefix cache (it went there when that request finished), so only the new turn is
computed: the reply's `cached_tokens` shows it. With --dp-size > 1 a continuation runs on the
replica that served the request it continues, where that KV is.

A session is a tree of finished requests (SGLang's SessionReqNode): a request continues one of
them (`rid`), or starts a new root (no rid); `replace` first drops the continued request's later
turns (or, without a rid, every turn); `offset` cuts the continued tokens before the new turn;
`drop_previous_output` leaves the continued request's output out. A request joins the tree when
it finishes (a rid still running cannot be continued yet: a 404 says so). Unlike SGLang, a turn
that `replace` drops while it runs is not aborted: it finishes for its client and is not kept.
Sessions live in the front process: the schedulers only ever see whole prompts, so they stay as
deterministic as ever, and a session's idle timeout can read the clock.

Bounds: at most MAX_OPEN_SESSIONS open; at most MAX_REQUESTS_PER_SESSION requests kept per
session; a continued prompt at most the session's capacity_of_str_len tokens; a session idle
for its `timeout` seconds is closed. Past a bound, a 4xx that says which."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from lockstep.messages import SessionParams

MAX_OPEN_SESSIONS = 1024
MAX_REQUESTS_PER_SESSION = 256


class SessionError(ValueError):
    """A session request refused: the message and the HTTP status it gets."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Turn:
    """One finished request of a session: its whole prompt and its output."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    parent: Turn | None
    dp_rank: int | None = None  # the replica that served it (with --dp-size > 1)
    children: list[Turn] = field(default_factory=list)


@dataclass
class Session:
    id: str
    capacity: int  # capacity_of_str_len: the longest prompt a turn may grow to, in tokens
    timeout: float | None  # seconds idle before it is closed; None: until closed
    turns: dict[str, Turn] = field(default_factory=dict)
    last_active: float = field(default_factory=time.monotonic)
    running: int = 0  # its requests still running: never closed for idleness meanwhile

    def drop(self, turn: Turn) -> None:
        """Forget `turn` and its later turns."""
        for child in turn.children:
            self.drop(child)
        self.turns.pop(turn.rid, None)


@dataclass
class Continuation:
    """What `begin` gives a request: its whole prompt, the replica to run on (None: any), and
    where it goes in its session once it has finished (`end`)."""

    input_ids: list[int]
    dp_rank: int | None
    session: Session
    parent: Turn | None


class SessionController:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    def open(self, capacity: int, session_id: str | None, timeout: float | None) -> str:
        self._reap()
        sid = session_id if session_id is not None else uuid.uuid4().hex
        if sid in self.sessions:
            raise SessionError(f"session_id: session {sid!r} is already open")
        if len(self.sessions) >= MAX_OPEN_SESSIONS:
            raise SessionError(f"{MAX_OPEN_SESSIONS} sessions are open, the most this server "
                               "keeps; close one first", status=429)
        self.sessions[sid] = Session(sid, capacity, timeout)
        return sid

    def close(self, session_id: str) -> None:
        """Close the session; its requests still running finish, and are not kept."""
        if self.sessions.pop(session_id, None) is None:
            raise SessionError(f"session_id: no open session {session_id!r}", status=404)

    def begin(self, params: SessionParams, new_ids: list[int],
              bos_token_id: int | None) -> Continuation:
        """A request of the session with the new turn `new_ids`: its whole prompt."""
        self._reap()
        session = self.sessions.get(params.id)
        if session is None:
            raise SessionError(f"session_params.id: no open session {params.id!r}", status=404)
        last = None
        if params.rid is not None and (last := session.turns.get(params.rid)) is None:
            raise SessionError(f"session_params.rid: session {params.id!r} has no finished "
                               f"request {params.rid!r}", status=404)
        if params.replace:  # its later turns (without a rid: every turn) are dropped
            for turn in (last.children if last is not None
                         else [t for t in session.turns.values() if t.parent is None]):
                session.drop(turn)
            if last is not None:
                last.children = []
        if len(session.turns) >= MAX_REQUESTS_PER_SESSION:
            raise SessionError(f"session {params.id!r} holds {MAX_REQUESTS_PER_SESSION} requests, "
                               "the most a session keeps; replace earlier turns or open a new "
                               "session", status=429)
        ids = list(new_ids)
        if last is not None:
            if ids and bos_token_id is not None and ids[0] == bos_token_id:
                ids = ids[1:]  # a continuation, not a new document
            before = last.input_ids + ([] if params.drop_previous_output else last.output_ids)
            ids = (before[:params.offset] if params.offset else before) + ids
        if len(ids) > session.capacity:
            raise SessionError(f"the session's prompt would be {len(ids)} tokens, more than its "
                               f"capacity_of_str_len ({session.capacity})")
        session.last_active = time.monotonic()
        session.running += 1
        return Continuation(ids, last.dp_rank if last is not None else None, session, last)

    def end(self, cont: Continuation, rid: str, output_ids: list[int] | None,
            dp_rank: int | None) -> None:
        """The request `rid` ended: kept as a turn to continue if it finished (`output_ids`),
        its session still open and the turn it continues not replaced meanwhile."""
        session, parent = cont.session, cont.parent
        session.running -= 1
        session.last_active = time.monotonic()
        if (output_ids is None or self.sessions.get(session.id) is not session
                or (parent is not None and session.turns.get(parent.rid) is not parent)):
            return
        turn = Turn(rid, cont.input_ids, list(output_ids), parent, dp_rank)
        if parent is not None:
            parent.children.append(turn)
        session.turns[rid] = turn

    def _reap(self) -> None:
        """Close the sessions idle past their timeout."""
        now = time.monotonic()
        for sid in [s.id for s in self.sessions.values() if s.timeout is not None
                    and not s.running and now - s.last_active > s.timeout]:
            del self.sessions[sid]
