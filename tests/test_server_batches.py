"""OpenAI's Batch API (/v1/files, /v1/batches) through the `openai` client against conftest's
shared `server`: lines run through their endpoint, results and errors in their files, bad
input files refused by line, other namespaces find nothing, cancelling stops new lines."""

from __future__ import annotations

import json
import time

import openai
import pytest
from openai_calls import MODEL, user

CHAT = "/v1/chat/completions"


def line(custom_id: str, body: dict, url: str = CHAT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_body(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": user(text), "max_tokens": 4, "temperature": 0,
            "ignore_eos": True} | extra  # fmt: skip


def upload(client, lines: list[dict]):
    data = "\n".join(json.dumps(item) for item in lines).encode()
    return client.files.create(file=("in.jsonl", data), purpose="batch")


def wait_ended(client, batch_id: str, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not end: {batch.status}")


def records(client, file_id: str) -> dict[str, dict]:
    text = client.files.content(file_id).text
    return {r["custom_id"]: r for r in map(json.loads, text.splitlines())}


def test_a_batch_runs_each_line_through_its_endpoint(openai_client):
    lines = [line(f"r{i}", chat_body(f"Hello {i}")) for i in range(5)]
    lines.append(line("bad", chat_body("x", max_tokens=-1)))
    uploaded = upload(openai_client, lines)
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = openai_client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"job": "t"}
    )
    batch = wait_ended(openai_client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "t"}
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    outputs = records(openai_client, batch.output_file_id)
    for i in range(5):
        body = chat_body(f"Hello {i}")
        del body["ignore_eos"]
        direct = openai_client.chat.completions.create(**body, extra_body={"ignore_eos": True})
        response = outputs[f"r{i}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["message"]["content"] == (
            direct.choices[0].message.content
        )
    failed = records(openai_client, batch.error_file_id)["bad"]["response"]
    assert failed["status_code"] == 400 and failed["body"]["error"]["param"] == "max_tokens"
    assert batch.id in [b.id for b in openai_client.batches.list().data]


def test_bad_input_files_and_other_namespaces(openai_client):
    bad_files = [
        [line("a", chat_body("x")), line("a", chat_body("y"))],  # custom_id twice
        [line("a", chat_body("x"), url="/v1/completions")],  # not the batch's endpoint
        [{"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}],
    ]
    for lines in bad_files:
        uploaded = upload(openai_client, lines)
        with pytest.raises(openai.BadRequestError) as exc:
            openai_client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                         completion_window="24h")  # fmt: skip
        assert exc.value.param == "input_file_id" and "line" in exc.value.message
    uploaded = upload(openai_client, [line("a", chat_body("x"))])
    other = openai_client.with_options(default_headers={"X-Cache-Salt": "other-tenant"})
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    assert exc.value.param == "purpose"
    assert openai_client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(uploaded.id)


def test_cancelling_stops_new_lines(openai_client):
    lines = [line(f"r{i}", chat_body(f"Long {i}", max_tokens=200)) for i in range(40)]
    uploaded = upload(openai_client, lines)
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                         completion_window="24h")  # fmt: skip
    assert openai_client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_ended(openai_client, batch.id)
    counts = batch.request_counts
    assert batch.status == "cancelled" and counts.completed + counts.failed < counts.total == 40
