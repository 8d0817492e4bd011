"""What the OpenAI API tests (tests/test_server_openai_*.py) share: calls through the official
`openai` client (conftest's `openai_client`) with short greedy defaults, a user turn, and
streamed chunks added up per choice."""

from __future__ import annotations

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}  # a random model may sample EOS; lengths stay exact without it


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def complete(client, stream: bool = False, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": NO_EOS} | kwargs
    return client.completions.create(stream=stream, **kwargs)


def chat(client, stream: bool = False, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": NO_EOS} | kwargs
    return client.chat.completions.create(stream=stream, **kwargs)


def streamed_text(chunks, chat_api: bool) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and finish reason per choice index, and all chunks."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    chunks = list(chunks)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat_api else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                assert choice.index not in finishes, "a choice finished twice"
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, chunks
