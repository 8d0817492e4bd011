"""Seeded pseudo-English text, tokenized with the real tokenizer to exact token counts."""

from __future__ import annotations

import random

WORDS = tuple(
    """
    the of and to in is that for it as with was on be by this are or from at an but not have
    they which one you were all we when there can had has will more if no their out so up said
    what its about than into them only other new some could time these two may first then do
    any like my now over such our man me even most made after also did many before must through
    back years where much your way well down should because each just those people how too
    little state good very make world still own see men work long get here between both life
    being under never day same another know while last might us great old year off come since
    against go came right used take three states himself few house use during without again place
    american around however home small found thought went say part once general high upon school
    every does got united left number course war until always away something fact though water
    less public put think almost hand enough far took head yet government system better set told
    nothing night end why called didn find going look asked later knew point next program city
    business give group toward young days let room president side social given present several
    order national possible rather second face per among form important often things looking
    early white case john become large big need four within felt along children saw best church
    ever least power development light thing seemed family interest want members mind country
    area others done turned although open god service certain kind problem began different door
    thus help means sense whole matter perhaps itself york times law human line above name example
    action company hands local show whether five history gave today either act feet across taken
    past quite anything having seen death experience body word half really week field car words
    already themselves information tell together college shall money period held keep sure real
    probably free seems political cannot behind miss question air office making brought whose
    special heard major problems ago became federal moment study available known result street
    economic boy position reason change south board individual job areas society west close turn
    love community true court force full seem am art according value process policy
    """.split()
)


class TextSource:
    """Draws seeded word sequences and returns them as token ids of an exact length."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tokenizer = tokenizer
        self.rng = rng

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def words(self, num_words: int) -> str:
        return " " + " ".join(self.rng.choice(WORDS) for _ in range(num_words))

    def tokens(self, num_tokens: int) -> list[int]:
        """`num_tokens` ids of fresh random words (words are about one token each)."""
        ids: list[int] = []
        while len(ids) < num_tokens:
            ids += self.encode(self.words(num_tokens - len(ids) + 4))
        return ids[:num_tokens]

    def fit(self, ids: list[int], num_tokens: int) -> list[int]:
        """`ids` cut or padded with random words to exactly `num_tokens`."""
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        return ids + self.tokens(num_tokens - len(ids))

    def tool_definitions(self, num_tokens: int) -> list[int]:
        """A system prompt of tool definitions (name, description, arguments), `num_tokens` long."""
        lines = ["You are an agent. Think, then call one tool per step.", "Tools:"]
        text_ids = self.encode("\n".join(lines))
        while len(text_ids) < num_tokens:
            text_ids += self.encode("\n" + self._tool_line())
        return text_ids[:num_tokens]

    def json_records(self, num_records: int) -> str:
        """A tool's JSON result: a list of `num_records` flat records of words and numbers."""
        keys = [self.rng.choice(WORDS) for _ in range(4)]
        lines = [
            "  {" + ", ".join(f'"{k}": ' + self._json_value() for k in keys) + "}"
            for _ in range(num_records)
        ]
        return "[\n" + ",\n".join(lines) + "\n]"

    def _json_value(self) -> str:
        if self.rng.random() < 0.5:
            return str(self.rng.randint(0, 999))
        return '"' + self.words(self.rng.randint(1, 3)).strip() + '"'

    def _tool_line(self) -> str:
        name = "_".join(self.rng.choice(WORDS) for _ in range(2))
        args = ", ".join(f"{self.rng.choice(WORDS)}: str" for _ in range(self.rng.randint(1, 3)))
        return f"- {name}({args}):{self.words(self.rng.randint(12, 30))}."
