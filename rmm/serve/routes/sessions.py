"""Sessions and their reflection jobs: append turns, end a session, post a whole one, poll a job."""

from __future__ import annotations

from fastapi import APIRouter

from rmm.serve.deps import API_PREFIX, IdPath, Limits, Service, Tenant, UserPath
from rmm.serve.schemas import (
    AddSessionIn,
    AddTurnsIn,
    AddTurnsOut,
    EndSessionIn,
    JobOut,
    TurnIn,
)
from rmm.types import Turn

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["sessions"])


def _check_turns(turns: list[TurnIn], limits: Limits) -> None:
    limits.count(len(turns), limits.config.max_memories, "turns")
    limits.texts([t.text for t in turns], "turns")


@router.post("/users/{user}/turns", response_model=AddTurnsOut, status_code=201)
def add_turns(user: UserPath, body: AddTurnsIn, tenant: Tenant, service: Service, limits: Limits) -> AddTurnsOut:
    """Append turns to the user's open session (kept until the session ends). The server numbers
    appended turns itself (<session id>:<position>), so a turn `id` is refused here rather than
    silently dropped (send ids with a whole session: `POST /v1/users/{user}/sessions`)."""
    _check_turns(body.turns, limits)
    for i, turn in enumerate(body.turns):
        if turn.id is not None:
            raise limits.refuse(f"turns[{i}].id: appended turns are numbered by the server (<session id>:<position>); "
                                "send turn ids only with a whole session (POST /v1/users/{user}/sessions)")
    turns = service.append_turns(tenant, user, [(t.speaker, t.text) for t in body.turns])
    return AddTurnsOut(user=user, session_id=turns[0].session_id, turn_ids=[t.id for t in turns])


@router.post("/users/{user}/sessions/end", response_model=JobOut, status_code=202)
def end_session(user: UserPath, tenant: Tenant, service: Service, body: EndSessionIn | None = None) -> JobOut:
    """Close the open session; prospective reflection turns it into topic memories in the background."""
    body = body or EndSessionIn()
    return JobOut.of(service.end_session(tenant, user, speakers=body.speakers, store_turns=body.store_turns))


@router.post("/users/{user}/sessions", response_model=JobOut, status_code=202)
def add_session(user: UserPath, body: AddSessionIn, tenant: Tenant, service: Service, limits: Limits) -> JobOut:
    """A whole finished session at once (e.g. importing history), reflected in the background."""
    _check_turns(body.turns, limits)
    turns = [Turn(id=t.id or "", session_id="", speaker=t.speaker, text=t.text, time=t.time) for t in body.turns]
    job = service.add_session(tenant, user, turns, session_id=body.session_id, time_=body.time,
                              speakers=body.speakers, store_turns=body.store_turns)
    return JobOut.of(job)


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: IdPath, tenant: Tenant, service: Service) -> JobOut:
    return JobOut.of(service.job(tenant, job_id))
