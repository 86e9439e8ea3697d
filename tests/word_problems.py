"""Grade-school word problems with worked solutions, generated from templates (no dataset is downloaded).

Each problem has a question, a step-by-step solution and a numeric answer. The stress
workload gives the teacher a long prompt (its own reference solution plus other worked
examples, different for every problem, so no two teacher prompts share more than the chat
template) and theta the question alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Maria", "Tomas", "Aiko", "Priya", "Omar", "Lena", "Kofi", "Sven", "Ines", "Ravi", "Noor", "Jonah"]
ITEMS = [
    ("box", "boxes", "pencils"),
    ("crate", "crates", "apples"),
    ("bag", "bags", "marbles"),
    ("shelf", "shelves", "books"),
    ("tray", "trays", "cookies"),
    ("pack", "packs", "stickers"),
    ("basket", "baskets", "eggs"),
    ("jar", "jars", "buttons"),
]


@dataclass(frozen=True)
class WordProblem:
    id: str
    question: str
    solution: str
    answer: int


def _groups(rng: random.Random, name: str) -> tuple[str, str, int]:
    (holder, holders, thing), k, per = rng.choice(ITEMS), rng.randint(3, 12), rng.randint(6, 25)
    gift = rng.randint(2, 30)
    total = k * per
    q = (
        f"{name} has {k} {holders} of {thing}. Each {holder} holds {per} {thing}. {name} gives {gift} {thing} "
        f"to a friend. How many {thing} does {name} have left?"
    )
    s = (
        f"First find how many {thing} {name} starts with. There are {k} {holders} and each holds {per}, so "
        f"{k} x {per} = {total} {thing}. Then {name} gives away {gift}, which leaves {total} - {gift} = "
        f"{total - gift} {thing}. The answer is {total - gift}."
    )
    return q, s, total - gift


def _wages(rng: random.Random, name: str) -> tuple[str, str, int]:
    rate, hours, days, spend = rng.randint(8, 30), rng.randint(2, 8), rng.randint(3, 6), rng.randint(10, 60)
    week = rate * hours * days
    q = (
        f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. After buying a present for "
        f"${spend}, how much money does {name} have from that work?"
    )
    s = (
        f"In one day {name} earns {rate} x {hours} = ${rate * hours}. Over {days} days that is {rate * hours} x "
        f"{days} = ${week}. The present costs ${spend}, so {week} - {spend} = ${week - spend} is left. "
        f"The answer is {week - spend}."
    )
    return q, s, week - spend


def _speed(rng: random.Random, name: str) -> tuple[str, str, int]:
    speed, hours, extra = rng.randint(30, 90), rng.randint(2, 6), rng.randint(5, 40)
    dist = speed * hours
    q = (
        f"A train leaves the station with {name} on board and travels at {speed} km per hour for {hours} hours. "
        f"Then it goes {extra} km more to reach the city. How far is the city from the station?"
    )
    s = (
        f"At {speed} km per hour for {hours} hours the train covers {speed} x {hours} = {dist} km. Adding the last "
        f"{extra} km gives {dist} + {extra} = {dist + extra} km. The answer is {dist + extra}."
    )
    return q, s, dist + extra


def _shares(rng: random.Random, name: str) -> tuple[str, str, int]:
    friends, each, kept = rng.randint(2, 6), rng.randint(3, 15), rng.randint(1, 12)
    total = friends * each + kept
    q = (
        f"{name} baked some muffins, shared them equally among {friends} friends so that each friend got {each}, "
        f"and kept {kept} for later. How many muffins did {name} bake?"
    )
    s = (
        f"The friends received {friends} x {each} = {friends * each} muffins together. {name} also kept {kept}, "
        f"so the total is {friends * each} + {kept} = {total}. The answer is {total}."
    )
    return q, s, total


def _price(rng: random.Random, name: str) -> tuple[str, str, int]:
    price, count, discount = rng.randint(4, 40), rng.randint(3, 9), rng.randint(1, 3)
    free = count // 3 * discount
    paid = (count - free) * price
    q = (
        f"A shop sells notebooks for ${price} each, and for every 3 notebooks bought, {discount} of them are free. "
        f"{name} takes {count} notebooks. How much does {name} pay?"
    )
    s = (
        f"{name} takes {count} notebooks, which contains {count // 3} full groups of 3, so {count // 3} x {discount} = "
        f"{free} notebooks are free. {name} pays for {count} - {free} = {count - free} notebooks at ${price} each: "
        f"{count - free} x {price} = ${paid}. The answer is {paid}."
    )
    return q, s, paid


TEMPLATES = [_groups, _wages, _speed, _shares, _price]


def word_problems(count: int, seed: int = 0) -> list[WordProblem]:
    """``count`` distinct problems, reproducible from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        q, s, a = TEMPLATES[i % len(TEMPLATES)](rng, rng.choice(NAMES))
        out.append(WordProblem(f"wp{i}", q, s, a))
    return out


def teacher_message(problem: WordProblem, examples: list[WordProblem]) -> str:
    """The teacher's user message: worked examples, then the problem with its reference solution as a hint."""
    shown = "\n\n".join(f"Example problem: {e.question}\nWorked solution: {e.solution}" for e in examples)
    return (
        f"Here are some worked examples.\n\n{shown}\n\nNow solve this problem. A reference solution follows; use it as "
        f"a hint and write your own complete answer.\n\nProblem: {problem.question}\nReference solution: "
        f"{problem.solution}"
    )


def long_teacher_prompts(
    tokenizer, problems: list[WordProblem], pool: list[WordProblem], low: int, high: int, seed: int = 1
) -> list[str]:
    """Chat-formatted teacher prompts of ``low``..``high`` tokens, uneven: each problem with its own examples."""
    rng = random.Random(seed)
    out = []
    for problem in problems:
        target = rng.randint(low, high - 120)  # one more example adds at most about 120 tokens
        candidates = [p for p in pool if p.id != problem.id]
        rng.shuffle(candidates)
        examples: list[WordProblem] = []
        while True:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": teacher_message(problem, examples)}],
                add_generation_prompt=True,
                tokenize=False,
            )
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if n >= target or not candidates:
                break
            examples.append(candidates.pop())
        if not low <= n <= high:
            raise ValueError(f"the teacher prompt of {problem.id} has {n} tokens, outside [{low}, {high}]")
        out.append(text)
    return out


def theta_prompts(tokenizer, problems: list[WordProblem]) -> list[str]:
    """Chat-formatted theta prompts: the question alone."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.question}], add_generation_prompt=True, tokenize=False
        )
        for p in problems
    ]
