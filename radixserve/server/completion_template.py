"""Fill-in-the-middle prompts for a completion's `suffix` (code completion: the editor sends
the code before the cursor as `prompt` and after it as `suffix`), in SGLang's
`--completion-template` formats. Without the flag the format is the one whose special tokens
the model's vocabulary holds (each a single token); a vocabulary with none of them has no
fill-in-the-middle, and a non-empty suffix is a 400 naming the flag."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletionTemplate:
    """SGLang's CompletionTemplate: `begin` + prefix, then the suffix between `end` and
    `middle` (middle_last, the prefix-suffix-middle order: StarCoder, Qwen) or between
    `middle` and `end` (DeepSeek-Coder's hole)."""

    name: str
    begin: str
    middle: str
    end: str
    middle_last: bool

    def prompt(self, prefix: str, suffix: str) -> str:
        if self.middle_last:
            return f"{self.begin}{prefix}{self.end}{suffix}{self.middle}"
        return f"{self.begin}{prefix}{self.middle}{suffix}{self.end}"

    @property
    def tokens(self) -> tuple[str, str, str]:
        return self.begin, self.middle, self.end


TEMPLATES = {
    t.name: t
    for t in (
        CompletionTemplate("deepseek_coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>",
                           middle_last=False),
        CompletionTemplate("star_coder", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
                           middle_last=True),
        CompletionTemplate("qwen_coder", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                           middle_last=True),
    )
}  # fmt: skip


def check_template_name(name: str | None) -> None:
    """--completion-template names a known format (checked before the model loads)."""
    if name is not None and name not in TEMPLATES:
        raise ValueError(
            f"--completion-template {name!r} is not a known format; choose from "
            + ", ".join(TEMPLATES)
        )


def resolve_completion_template(name: str | None, tokenizer) -> CompletionTemplate | None:
    """The format `name` gives (its tokens must be single tokens of the vocabulary), else the
    first whose tokens the vocabulary holds; None when none fits."""
    check_template_name(name)
    if name is not None:
        template = TEMPLATES[name]
        missing = [t for t in template.tokens if not _is_token(tokenizer, t)]
        if missing:
            raise ValueError(
                f"--completion-template {name}: the model's vocabulary has no {missing[0]!r} token"
            )
        return template
    for template in TEMPLATES.values():
        if all(_is_token(tokenizer, t) for t in template.tokens):
            return template
    return None


def fim_prompt(template: CompletionTemplate | None, prefix: str, suffix: str) -> str:
    """The prompt that fills the middle between `prefix` and a non-empty `suffix` (callers
    send an empty suffix's prompt as it is)."""
    if template is None:
        raise ValueError(
            "suffix needs a fill-in-the-middle format: this model's vocabulary has none of "
            f"{', '.join(TEMPLATES)}' tokens (--completion-template names one)"
        )
    return template.prompt(prefix, suffix)


def _is_token(tokenizer, text: str) -> bool:
    """`text` is one token of the vocabulary (not split, not the unknown token)."""
    return len(tokenizer.encode(text, add_special_tokens=False)) == 1 and (
        tokenizer.convert_tokens_to_ids(text) not in (None, tokenizer.unk_token_id)
    )
