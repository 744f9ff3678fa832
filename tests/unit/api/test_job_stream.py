"""The native stream's resume position: a reconnect with a delta's id gets the rest, nothing twice."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.api import job_stream
from app.api.job_stream import StreamPosition, resume_point, sse_events
from app.services.streaming import StreamEvent

EVENTS = [
    StreamEvent("delta", text="Hello", token_ids=[1, 2], data={"logprobs": [{"t": 1}, {"t": 2}]}),
    StreamEvent("status", status="relegated"),
    StreamEvent("delta", text=" world", token_ids=[3], data={"logprobs": [{"t": 3}]}),
    # the stream lost the last delta: SQL's end has the whole text
    StreamEvent("end", status="succeeded", finish_reason="stop",
                data={"from_sql": True, "output_text": "Hello world!", "logprobs": [{"t": 1}, {"t": 2}, {"t": 3},
                                                                                     {"t": 4}]}),
]


def _read(monkeypatch, resume: StreamPosition | None) -> list[tuple[str | None, str, dict]]:
    async def job_events(_settings, _job_id):
        for ev in EVENTS:
            yield ev

    async def collect() -> list[bytes]:
        return [chunk async for chunk in sse_events(None, "job-1", resume)]

    monkeypatch.setattr(job_stream, "job_events", job_events)
    out = []
    for chunk in asyncio.run(collect()):
        fields = dict(line.split(": ", 1) for line in chunk.decode().strip().split("\n"))
        out.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return out


def test_each_delta_names_its_job_and_the_position_after_it_and_the_end_is_named_end(monkeypatch):
    events = _read(monkeypatch, None)
    assert [(i, name) for i, name, _ in events] == [("job-1:5.2.2", "delta"), (None, "status"),
                                                    ("job-1:11.3.3", "delta"), ("job-1:12.3.4", "delta"),
                                                    ("job-1:end", "end")]
    assert events[3][2] == {"text": "!", "token_ids": [], "logprobs": [{"t": 4}]}  # the rest from SQL


@pytest.mark.parametrize("resume, first", [
    ("5.2.2", ("status", {"status": "relegated"})),  # the status at the resume point comes again
    ("11.3.3", ("delta", {"text": "!", "token_ids": [], "logprobs": [{"t": 4}]})),
    ("7.2.2", ("delta", {"text": "orld", "token_ids": [3], "logprobs": [{"t": 3}]})),  # inside a delta
    ("12.3.4", ("end", None)),
    ("99.9.9", ("end", None)),  # past the end: only the end
])
def test_a_resume_sends_what_follows_its_position(monkeypatch, resume, first):
    events = _read(monkeypatch, StreamPosition.parse(resume))
    name, data = first
    assert events[0][1] == name and (data is None or events[0][2] == data)
    assert events[-1][1] == "end" and events[-1][2]["status"] == "succeeded"
    text = "".join(d["text"] for _, n, d in events if n == "delta")
    assert text == "Hello world!"[min(int(resume.split(".")[0]), 12):]


@pytest.mark.parametrize("bad", ["7", "a.b.c", "1.2", "-1.0.0", "1.2.3.4", "1" * 13 + ".0.0", "", "\u00b2.0.0"])
def test_an_id_this_stream_never_sent_is_refused_with_what_to_do(bad):
    with pytest.raises(ValueError, match="leave it out"):
        StreamPosition.parse(bad)


@pytest.mark.parametrize("last_event_id, resume", [
    ("job-1:5.2.2", StreamPosition(5, 2, 2)), ("job-1:end", None),
    ("5.2.2", StreamPosition(5, 2, 2)), ("end", None),  # ids sent before they named their job
])
def test_a_resume_point_is_an_id_of_this_jobs_stream(last_event_id, resume):
    assert resume_point("job-1", last_event_id) == resume


@pytest.mark.parametrize("last_event_id", ["job-2:5.2.2", "job-2:end"])
def test_an_id_of_another_jobs_stream_is_refused_naming_both_jobs(last_event_id):
    with pytest.raises(ValueError, match="of job 'job-2'.s stream, not of 'job-1'"):
        resume_point("job-1", last_event_id)
