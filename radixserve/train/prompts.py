"""The prompts `radixserve train-eagle` distills from: generic chat requests built from
public-domain text shipped here (no download), in a fixed, seeded order.

Sources (all in the public domain): short quotations from works published before 1929 --
A. Lincoln, Gettysburg Address (1863); the U.S. Declaration of Independence (1776);
J. Austen, Pride and Prejudice (1813); C. Dickens, A Tale of Two Cities (1859);
H. Melville, Moby-Dick (1851); W. Shakespeare, Sonnet 18 (1609) and Hamlet (1603);
H. D. Thoreau, Walden (1854); C. Darwin, On the Origin of Species (1859); B. Franklin,
Poor Richard's Almanack (1732-58); the King James Bible, Ecclesiastes 1 (1611); and
R. W. Emerson, Self-Reliance (1841) -- plus the topic words and request templates below,
written for this project and dedicated to the public domain with it.
"""

from __future__ import annotations

import random


def _items(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


SOURCE = "radixserve/train/prompts.py (public-domain quotations, topics and templates)"

PASSAGES = (
    "Four score and seven years ago our fathers brought forth on this continent, a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are "
    "created equal.",
    "We hold these truths to be self-evident, that all men are created equal, that they "
    "are endowed by their Creator with certain unalienable Rights, that among these are "
    "Life, Liberty and the pursuit of Happiness.",
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would "
    "sail about a little and see the watery part of the world.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
    "Rough winds do shake the darling buds of May, and summer's lease hath all too short "
    "a date.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "I went to the woods because I wished to live deliberately, to front only the essential "
    "facts of life, and see if I could not learn what it had to teach.",
    "There is grandeur in this view of life, with its several powers, having been "
    "originally breathed into a few forms or into one; and that, whilst this planet has "
    "gone cycling on according to the fixed law of gravity, from so simple a beginning "
    "endless forms most beautiful and most wonderful have been, and are being, evolved.",
    "Early to bed and early to rise, makes a man healthy, wealthy and wise.",
    "One generation passeth away, and another generation cometh: but the earth abideth "
    "for ever. The sun also ariseth, and the sun goeth down, and hasteth to his place "
    "where he arose.",
    "Trust thyself: every heart vibrates to that iron string.",
    "A penny saved is a penny earned.",
    "The mass of men lead lives of quiet desperation.",
    "The fault, dear Brutus, is not in our stars, but in ourselves.",
    "All the world's a stage, and all the men and women merely players.",
)

PASSAGE_TEMPLATES = (
    "Summarize this passage in two sentences:\n\n{text}",
    'Explain in simple words what this means: "{text}"',
    'Write a short story that begins with: "{text}"',
    "What is the main idea of the following text?\n\n{text}",
    'Rewrite this in modern everyday English: "{text}"',
    "List three questions a student might ask about this passage:\n\n{text}",
)

TOPICS = _items(
    """
    bread, rivers, sailing ships, clocks, paper, glass, salt, iron, the moon, volcanoes,
    honey bees, libraries, the printing press, bridges, photosynthesis, the water cycle,
    gravity, electricity, magnets, rainbows, the human heart, sleep, vaccines, the internet,
    prime numbers, fractions, the Roman Empire, ancient Egypt, the Silk Road, trains, bicycles,
    coffee, tea, chess, music theory, the piano, gardening, compost, recycling, solar power,
    wind turbines, earthquakes, glaciers, deserts, rainforests, whales, owls, ants, dinosaurs,
    the solar system, black holes, telescopes, microscopes, bacteria, the immune system,
    nutrition, exercise, meditation, time management, saving money, budgeting, job interviews,
    public speaking, writing an essay, learning a language, the alphabet, maps, compasses,
    weather forecasts, clouds, snowflakes, the ocean tides, lighthouses, kites, airplanes,
    rockets, satellites, computers, algorithms, databases, sorting lists, binary numbers,
    encryption, passwords, spreadsheets, email, cooking rice, baking a cake, making soup,
    friendship, kindness, patience, democracy, elections, taxes, banks, markets,
    the stock market, farming, wheat, cotton, wool, cheese, chocolate, olive oil, camping,
    hiking, first aid, fire safety, swimming, football, the Olympic Games, painting, poetry,
    theatre, museums, photography, origami, knitting, carpentry
    """
)

TOPIC_TEMPLATES = (
    "What is {topic}?",
    "Explain how {topic} works.",
    "Give me three interesting facts about {topic}.",
    "Write a short poem about {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short paragraph about the history of {topic}.",
    "What should a beginner know about {topic}?",
)

CODE_TASKS = _items(
    """
    reverses a string, checks whether a number is prime, sums a list of numbers,
    counts the words in a sentence, finds the largest item in a list,
    computes the factorial of n, returns the n-th Fibonacci number,
    removes duplicates from a list, converts Celsius to Fahrenheit,
    checks whether a word is a palindrome, sorts a list of names, merges two dictionaries
    """
)


def build_prompts(num: int | None = None, seed: int = 0) -> list[str]:
    """Up to `num` user messages (None: all), shuffled by `seed`."""
    prompts = [t.format(text=p) for p in PASSAGES for t in PASSAGE_TEMPLATES]
    prompts += [t.format(topic=topic) for topic in TOPICS for t in TOPIC_TEMPLATES]
    prompts += [f"Write a Python function that {task}." for task in CODE_TASKS]
    random.Random(seed).shuffle(prompts)
    return prompts if num is None else prompts[:num]
