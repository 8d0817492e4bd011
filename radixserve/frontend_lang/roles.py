"""Role markers from the model's own chat template.

The template is rendered with sentinel contents and split around them, so `user("hi")`
writes exactly what `tokenizer.apply_chat_template` writes for that message:

    render([system A, user B]) = render([system A]) + user_prefix + B + user_suffix

A default system prompt that the template injects when the first message is not a system
one (SmolLM2 does) is recovered the same way and written by the program before its first
non-system role, so a program's text is always the template's rendering of its messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
SENTINELS = {"system": "RADIXSERVE_SYSTEM_0", "user": "RADIXSERVE_USER_1",
             "assistant": "RADIXSERVE_ASSISTANT_2"}  # fmt: skip


@dataclass(frozen=True)
class ChatTemplate:
    """Prefix and suffix text of each role; `first_prefix` precedes the first message."""

    role_prefix: dict[str, str]
    role_suffix: dict[str, str]
    default_system_prompt: str | None = None
    first_prefix: str = ""
    stop_str: tuple[str, ...] = field(default=())

    def prefix(self, role: str, first: bool) -> str:
        """The text opening `role`; `first`: nothing precedes it in the program's text."""
        if role not in self.role_prefix:
            raise ValueError(f"role must be one of {sorted(self.role_prefix)}; got {role!r}")
        return (self.first_prefix if first else "") + self.role_prefix[role]

    def suffix(self, role: str) -> str:
        return self.role_suffix[role]

    @classmethod
    def plain(cls) -> ChatTemplate:
        """SGLang's "default" template, for tokenizers without a chat template."""
        return cls(
            role_prefix={"system": "SYSTEM:", "user": "USER:", "assistant": "ASSISTANT:"},
            role_suffix={role: "\n" for role in ROLES},
        )

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatTemplate:
        """Derives the role markers by rendering the tokenizer's chat template."""
        if getattr(tokenizer, "chat_template", None) is None:
            return cls.plain()
        try:
            return _derive(_Renderer(tokenizer))
        except Exception as exc:  # e.g. a template that refuses a system message
            raise ValueError(
                f"cannot derive role markers from this chat template ({exc}); pass "
                f"chat_template=ChatTemplate(...) to the backend"
            ) from exc


class _Renderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        bos = getattr(tokenizer, "bos_token", None) or ""
        # A BOS the template writes itself, unless encode() adds one anyway (then drop it,
        # or the prompt would start with two).
        writes_bos = bool(bos) and "bos_token" in tokenizer.chat_template
        adds_bos = (
            bool(bos)
            and bool(tokenizer.encode(""))
            and tokenizer.encode("")[0] == (tokenizer.convert_tokens_to_ids(bos))
        )
        self.bos = bos if writes_bos else ""
        self.strip_bos = writes_bos and adds_bos

    def __call__(self, messages: list[tuple[str, str]], generation_prompt: bool = False) -> str:
        msgs = [{"role": role, "content": content} for role, content in messages]
        text = self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=generation_prompt
        )
        return text.removeprefix(self.bos) if self.strip_bos else text


def _split(whole: str, head: str, sentinel: str, role: str) -> tuple[str, str]:
    """(prefix, suffix) of the message appended to `head` in `whole`."""
    if not whole.startswith(head) or sentinel not in whole[len(head) :]:
        raise ValueError(f"cannot derive the {role!r} role markers from this chat template")
    prefix, suffix = whole[len(head) :].split(sentinel, 1)
    return prefix, suffix


def _derive(render: _Renderer) -> ChatTemplate:
    s, u, a = SENTINELS["system"], SENTINELS["user"], SENTINELS["assistant"]
    system_first = _split(render([("system", s)]), "", s, "system")
    base = [("system", s)]
    user = _split(render(base + [("user", u)]), render(base), u, "user")
    turn = base + [("user", u)]
    assistant = _split(render(turn + [("assistant", a)]), render(turn), a, "assistant")
    system = _later_system(render, turn, system_first)
    first_prefix = system_first[0].removesuffix(system[0]) if system_first[0] != system[0] else ""
    prefix = {"system": system[0], "user": user[0], "assistant": assistant[0]}
    suffix = {"system": system[1], "user": user[1], "assistant": assistant[1]}
    default = _default_system(render, prefix, suffix, first_prefix)
    stop = assistant[1].strip()
    return ChatTemplate(prefix, suffix, default, first_prefix, (stop,) if stop else ())


def _later_system(render: _Renderer, turn, system_first: tuple[str, str]) -> tuple[str, str]:
    """A system message's markers when it is not the first message (no BOS, no preamble)."""
    s = SENTINELS["system"] + "_later"
    try:
        later = _split(render(turn + [("system", s)]), render(turn), s, "system")
    except Exception:  # templates may refuse a system message after the first turn
        return system_first
    return later if system_first[0].endswith(later[0]) else system_first


def _default_system(render: _Renderer, prefix, suffix, first_prefix: str) -> str | None:
    """The system prompt the template injects before a conversation that has none."""
    u = SENTINELS["user"]
    text = render([("user", u)])
    head = text[: text.find(prefix["user"] + u)].removeprefix(first_prefix)
    if head.startswith(prefix["system"]) and head.endswith(suffix["system"]) and head:
        return head[len(prefix["system"]) : len(head) - len(suffix["system"])]
    return None
