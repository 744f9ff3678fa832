"""A conversation's items are read with a fixed number of queries, however many responses it holds."""

from __future__ import annotations

from sqlalchemy import event

from app.db.models import Conversation, ConversationEntry, Job, Tenant
from app.db.session import session_scope
from app.services import conversations


def _conversation(session, turns: int) -> Conversation:
    session.add(Tenant(id="t1", name="t1", default_tier="paid"))
    session.flush()
    conv = Conversation(id="conv_1", tenant_id="t1")
    session.add(conv)
    session.flush()
    for i in range(turns):
        job = Job(tenant_id="t1", kind="interactive", tier="paid", model="tiny", status="succeeded", sampling={},
                  messages=[{"role": "user", "content": f"question {i}"}], response={}, output_text=f"answer {i}",
                  finish_reason="stop")
        session.add(job)
        session.flush()
        session.add(ConversationEntry(conversation_id=conv.id, job_id=job.id))
    session.add(ConversationEntry(conversation_id=conv.id, item={"id": "msg_own", "type": "message",
                                                                 "role": "user", "content": [{"type": "input_text",
                                                                                              "text": "own"}]}))
    session.commit()
    return conv


def test_items_and_a_new_turn_read_the_turns_jobs_in_one_query(db_url):
    with session_scope(db_url) as s:
        conv = _conversation(s, turns=12)
        s.expire_all()  # nothing cached: every job is read from SQL
        statements: list[str] = []
        engine = s.get_bind()
        listen = lambda conn, cursor, sql, *rest: statements.append(sql)  # noqa: E731
        event.listen(engine, "before_cursor_execute", listen)
        try:
            items = conversations.items_of(s, conv)
            s.expire_all()
            messages = conversations.take_turn(s, conv, "job_new")
        finally:
            event.remove(engine, "before_cursor_execute", listen)
    texts = [item["content"][0]["text"] for _, item in items]
    assert texts[:4] == ["question 0", "answer 0", "question 1", "answer 1"] and texts[-1] == "own"
    assert len(messages) == 25 and messages[-1] == {"role": "user", "content": "own"}
    job_reads = [sql for sql in statements if "FROM jobs" in sql]
    # items_of: one read of the jobs; take_turn: one for the lock check, one for the history it reads
    assert len(job_reads) <= 3, job_reads


def test_a_conversations_items_of_several_parts_reach_the_template_as_vllm_reads_them_as_input(db_url):
    # a conversation's items (added by a client, or a response's own input) come before a response's input: a
    # template that loops over a message's parts ("openai" content format) reads each item's parts as vLLM reads
    # the same items given as the input
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    from app.responses_schemas import ResponsesRequest
    from app.services.jobs import encode_spec
    from app.services.model_info import get_tokenizer, use_chat_template
    from tests.unit.api.test_chat_template_inputs import MODEL, PARTS_LOOP
    from tests.unit.api.test_responses_conversation import PARTED_ASK, vllm_read

    added = {**PARTED_ASK, "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}
    first = {"model": "tiny", "input": [PARTED_ASK], "conversation": "conv_1"}
    then = {"model": "tiny", "input": "And tomorrow?", "conversation": "conv_1"}
    use_chat_template(MODEL, PARTS_LOOP)
    try:
        with session_scope(db_url) as s:
            s.add(Tenant(id="t1", name="t1", default_tier="paid"))
            s.flush()
            conv = Conversation(id="conv_1", tenant_id="t1")
            s.add(conv)
            s.flush()
            conversations.add_items(s, conv, conversations.new_items([added, said]))
            body = ResponsesRequest.model_validate(first)
            history = conversations.take_turn(s, conv, "job_first")
            _, spec = body.chat_request(first, history)
            s.add(Job(id="job_first", tenant_id="t1", kind="interactive", tier="paid", model="tiny",
                      status="succeeded", sampling={}, messages=[m.stored() for m in spec.messages],
                      response=body.kept(history), output_text="Sunny.", finish_reason="stop"))
            s.flush()
            _, spec = ResponsesRequest.model_validate(then).chat_request(then, conversations.take_turn(s, conv, "j2"))
            ids = encode_spec(MODEL, spec)
        answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}
        as_input = construct_input_messages(request_input=VllmResponsesRequest.model_validate(
            {"model": "tiny", "input": [added, said, PARTED_ASK, answer, {"role": "user", "content": "And tomorrow?"}]}
        ).input)
        assert ids == vllm_read(get_tokenizer(MODEL), as_input, PARTS_LOOP)
    finally:
        use_chat_template(MODEL, None)
