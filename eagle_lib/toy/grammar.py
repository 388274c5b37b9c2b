"""Small grammars that generate the toy world's conversations, deterministically from a ``random.Random``.

Every generator returns a canonical conversation ``{"domain", "messages", "tools"}`` in OpenAI style
(assistant messages may carry ``reasoning_content`` and ``tool_calls``); ``datasets`` re-serialises them into
each public schema. The vocabulary is deliberately small so a tiny target can learn it, and lengths differ by
domain as in real data: tool calls short, chat medium, reasoning long.

``style="native"`` is how the toy target answers (its own A data and its training set); ``style="foreign"`` is
how the public B datasets answer (another model's phrasing), which is why B data gets regenerated.
"""

from __future__ import annotations

import math
import random

# the vocabulary, kept small so a tiny target learns it ("|"-separated to stay compact)
TOPICS = (
    "the moon|coffee|rivers|bicycles|volcanoes|honey bees|libraries|trains|forests|the ocean|chess|bread|rain|"
    "mountains|music|gardens|bridges|clocks|maps|whales|deserts|islands|owls|kites|castles|lakes|tea|snow|"
    "lighthouses|markets"
).split("|")
ASPECTS = "history|shape|sound|color|size|use|age|speed".split("|")
ADJS = "old|quiet|bright|small|large|simple|strong|gentle|fast|slow|warm|cold".split("|")
ACTIVITIES = (
    "learning to cook|running every day|reading more books|sleeping better|saving money|writing clearly|"
    "learning a language|keeping a garden"
).split("|")
TIPS = (
    "Start with small steps each day.|Keep a simple plan and follow it.|Ask a friend to join you.|"
    "Write down what you learn.|Rest when you feel tired.|Set a clear goal for each week.|"
    "Do a little every morning.|Track your progress in a notebook.|Be patient with yourself.|"
    "Remove one distraction at a time."
).split("|")
OPENERS = ["", "", "Hi! ", "Please help me. ", "I am curious. ", "Quick question. "]
NAMES = "Alice|Bob|Carol|David|Emma|Frank|Grace|Henry|Ivy|Jack".split("|")
CITIES = "Paris|London|Tokyo|Berlin|Madrid|Rome|Cairo|Lima|Oslo|Delhi|Sydney|Toronto|Nairobi|Seoul".split("|")
ITEMS = "apples|pencils|books|cups|stamps|marbles|cookies|tickets".split("|")
CONDITIONS = "sunny|cloudy|rainy|windy|snowy".split("|")
CURRENCIES = "USD|EUR|GBP|JPY|CHF".split("|")
SYMBOLS = "AAPL|MSFT|TSLA|AMZN|NVDA".split("|")
LANGS = "French|Spanish|German|Italian".split("|")


def _pick(rng: random.Random, xs: list) -> object:
    return xs[rng.randrange(len(xs))]


def _msg(role: str, content: str, **extra) -> dict:
    return {"role": role, "content": content, **extra}


# ---------------------------------------------------------------- chat (medium length)


def _facts(rng: random.Random, topic: str, n: int) -> list[str]:
    return [
        f"The {a} of {topic} is {_pick(rng, ADJS)} and {_pick(rng, ADJS)}." for a in rng.sample(ASPECTS, n)
    ]


def _native_chat(rng: random.Random, kind: str, topic: str, n: int, aspect: str) -> tuple[str, str]:
    """(reasoning, answer) in the target's own style: a fixed shape per prompt kind, so a tiny model can
    learn where an answer ends (greedy decoding loops when the length is a coin toss)."""
    adj, adj2 = _pick(rng, ADJS), _pick(rng, ADJS)
    if kind == "tips":
        body = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(rng.sample(TIPS, n)))
        return f"I will give {n} tips.", f"Here are {n} tips for {topic}:\n{body}\nGood luck with {topic}!"
    if kind == "poem":
        lines = [
            f"Oh {topic}, so {_pick(rng, ADJS)}, your {a} is {_pick(rng, ADJS)}."
            for a in rng.sample(ASPECTS, 4)
        ]
        return "I will write a poem of four lines.", "\n".join(lines) + f"\nThat is my poem about {topic}."
    if kind == "aspect":
        answer = (f"The {aspect} of {topic} is {adj} and {adj2}. Most people notice it first. "
                  f"In short, the {aspect} of {topic} is worth a look.")  # fmt: skip
        return f"I will describe the {aspect}.", answer
    if kind == "explain":
        f1, f2 = _facts(rng, topic, 2)
        return (
            "I will explain it in two sentences.",
            f"In simple words, {topic} is {adj}. {f1} {f2} That is the main idea.",
        )
    body = "\n".join(f"{i + 1}. {f}" for i, f in enumerate(_facts(rng, topic, 3)))
    answer = f"{topic.capitalize()} is a {adj} subject. Here are three facts:\n{body}\nIn short, {topic} is {adj2} and worth learning about."
    return "I will give three facts and a short summary.", answer


def _foreign_chat(rng: random.Random, kind: str, topic: str, n: int) -> str:
    """Answer in another model's style (B data): different phrasing, free length."""
    if kind == "tips":
        body = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(rng.sample(TIPS, n)))
        return f"Sure! Below are {n} ideas for {topic}.\n{body}\nI hope these ideas help you."
    if kind == "poem":
        return "\n".join(
            f"{topic.capitalize()} is {_pick(rng, ADJS)}, its {a} is {_pick(rng, ADJS)}."
            for a in rng.sample(ASPECTS, rng.randint(2, 6))
        )
    facts = " ".join(_facts(rng, topic, rng.randint(2, 6)))
    return (f"Great question! {topic.capitalize()} has many sides. {facts} Many people find {topic} "
            f"{_pick(rng, ADJS)}. Let me know if you want more details.")  # fmt: skip


def chat_turn(rng: random.Random, style: str) -> tuple[str, str, str]:
    """One (user, reasoning, answer) chat exchange."""
    kind = _pick(rng, ["about", "about", "aspect", "explain", "tips", "poem"])
    n, aspect = rng.randint(2, 4), _pick(rng, ASPECTS)
    topic = _pick(rng, ACTIVITIES if kind == "tips" else TOPICS)
    user = {
        "about": f"Tell me about {topic}.",
        "aspect": f"What can you tell me about the {aspect} of {topic}?",
        "explain": f"Explain {topic} in simple words.",
        "tips": f"Give me {n} tips for {topic}.",
        "poem": f"Write a short poem about {topic}.",
    }[kind]
    if style == "native":
        think, answer = _native_chat(rng, kind, topic, n, aspect)
        think = f"The user asks about {topic}. {think}"
    else:
        think, answer = "", _foreign_chat(rng, kind, topic, n)
    return _pick(rng, OPENERS) + user, think, answer


def gen_chat(rng: random.Random, style: str = "native", max_turns: int = 3) -> dict:
    """A 1..max_turns chat conversation; native assistant turns carry a short reasoning_content."""
    msgs = []
    if rng.random() < 0.3:
        msgs.append(_msg("system", "You are a friendly assistant. Answer in plain words."))
    for _ in range(rng.randint(1, max_turns)):
        user, think, answer = chat_turn(rng, style)
        msgs.append(_msg("user", user))
        extra = {"reasoning_content": think} if style == "native" else {}
        msgs.append(_msg("assistant", answer, **extra))
    return {"domain": "chat", "messages": msgs, "tools": None}


# ---------------------------------------------------------------- reasoning (long <think>)


def _double_check(rng: random.Random, a: int, b: int, op: str, res: int) -> str:
    lines = [f"Wait, let me double-check {a} {op} {b}."]
    lines += [f"{a} {op} {b} = {res}. Yes, that is right." for _ in range(rng.randint(1, 2))]
    return " ".join(lines)


def _times_table(b: int, c: int) -> list[str]:
    """Multiplication as repeated addition: the long, checkable kind of step reasoning models write."""
    return [f"{b} * {k} = {b * (k - 1)} + {b} = {b * k}." for k in range(2, c + 1)]


def _math_arith(rng: random.Random) -> tuple[str, list[str], int]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 20), rng.randint(4, 24)
    bc, res = b * c, a + b * c
    steps = (
        [
            f"I need to compute {a} + {b} * {c}.",
            "Multiplication comes before addition.",
            f"Let me compute {b} * {c} by adding {b} again and again.",
        ]
        + _times_table(b, c)
        + [
            f"So {b} * {c} = {bc}.",
            _double_check(rng, b, c, "*", bc),
            f"Then, {a} + {bc} = {res}.",
            _double_check(rng, a, bc, "+", res),
        ]
    )
    return f"Calculate {a} + {b} * {c}.", steps, res


def _math_sum(rng: random.Random) -> tuple[str, list[str], int]:
    n = rng.randint(8, 40)
    steps, total = [f"I need the sum of the numbers from 1 to {n}.", "Let me add them one by one."], 0
    for i in range(1, n + 1):
        steps.append(f"{total} + {i} = {total + i}.")
        total += i
    steps += [
        f"So the sum is {total}.",
        f"Let me check with the formula: {n} * {n + 1} / 2 = {total}.",
        "Both ways agree.",
    ]
    return f"What is the sum of the numbers from 1 to {n}?", steps, total


def _math_prime(rng: random.Random) -> tuple[str, list[str], str]:
    n = rng.randint(11, 599)
    steps, d = [f"I need to check if {n} is a prime number.", "I will try to divide it by small numbers."], 2
    while d * d <= n:
        q, r = divmod(n, d)
        steps.append(f"{n} / {d} = {q} with remainder {r}.")
        if r == 0:
            steps.append(f"The remainder is 0, so {d} divides {n}.")
            return f"Is {n} a prime number?", steps, "no"
        d += 1
    steps.append(f"No number up to {d - 1} divides {n}, so {n} is prime.")
    return f"Is {n} a prime number?", steps, "yes"


def _math_word(rng: random.Random) -> tuple[str, list[str], int]:
    name, name2, item = *rng.sample(NAMES, 2), _pick(rng, ITEMS)
    n, m = rng.randint(5, 60), rng.randint(2, 30)
    k = rng.randint(1, n + m - 1)
    res = n + m - k
    user = f"{name} has {n} {item}. {name} buys {m} more and gives {k} to {name2}. How many {item} does {name} have now?"
    steps = [
        f"{name} starts with {n} {item}.",
        f"After buying {m} more, {name} has {n} + {m} = {n + m}.",
        _double_check(rng, n, m, "+", n + m),
        f"Then {name} gives away {k}, so {n + m} - {k} = {res}.",
        _double_check(rng, n + m, k, "-", res),
        "Let me verify by counting the gifts one at a time.",
    ]
    steps += [f"{n + m - j + 1} - 1 = {n + m - j}." for j in range(1, min(k, 30) + 1)]
    steps.append(f"So {name} has {res} {item} now.")
    return user, steps, res


def gen_reasoning(rng: random.Random, style: str = "native") -> dict:
    """A math question with a long step-by-step reasoning and a short final answer."""
    maker = _pick(rng, [_math_arith, _math_sum, _math_prime, _math_word])
    user, steps, ans = maker(rng)
    steps = ["Okay, let me think about this carefully.", f"The question is: {user}"] + steps
    steps.append(f"Let me reread the question once more. {user} Yes, I answered what was asked: {ans}.")
    reasoning = "\n".join(steps)
    if style == "native":
        answer = f"The answer is {ans}."
    else:
        answer = f"To solve this, we work step by step.\n\nTherefore, the final answer is $\\boxed{{{ans}}}$."
    return {
        "domain": "reasoning",
        "messages": [_msg("user", user), _msg("assistant", answer, reasoning_content=reasoning)],
        "tools": None,
    }


# ---------------------------------------------------------------- code (medium)


def _nums(rng: random.Random) -> list[int]:
    return [rng.randint(-9, 99) for _ in range(rng.randint(2, 6))]


def _word(rng: random.Random) -> str:
    return _pick(rng, ["level", "hello", "python", "noon", "banana", "racecar", "toy", "eagle"])


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


# (name, description, argument, body lines, example-input maker, reference implementation)
CODE_TASKS = [
    ("sum_list", "returns the sum of a list of numbers", "numbers",
     ["total = 0", "for x in numbers:", "    total += x", "return total"], _nums, sum),
    ("reverse_string", "returns the string reversed", "text", ["return text[::-1]"], _word, lambda t: t[::-1]),
    ("count_vowels", "counts the vowels in a string", "text",
     ["count = 0", "for ch in text:", "    if ch in 'aeiou':", "        count += 1", "return count"], _word,
     lambda t: sum(c in "aeiou" for c in t)),
    ("factorial", "returns the factorial of n", "n",
     ["result = 1", "for i in range(2, n + 1):", "    result *= i", "return result"], lambda r: r.randint(1, 9),
     math.factorial),
    ("is_palindrome", "checks if a string is a palindrome", "text", ["return text == text[::-1]"], _word,
     lambda t: t == t[::-1]),
    ("max_value", "returns the largest number in a list", "numbers",
     ["best = numbers[0]", "for x in numbers:", "    if x > best:", "        best = x", "return best"], _nums, max),
    ("fibonacci", "returns the n-th Fibonacci number", "n",
     ["a, b = 0, 1", "for _ in range(n):", "    a, b = b, a + b", "return a"], lambda r: r.randint(1, 20), _fib),
    ("to_fahrenheit", "converts Celsius to Fahrenheit", "celsius", ["return celsius * 9 / 5 + 32"],
     lambda r: r.randint(-20, 100), lambda c: c * 9 / 5 + 32),
]  # fmt: skip
CODE_ASKS = [
    "Write a Python function `{f}` that {d}.",
    "Implement `{f}` in Python: it {d}.",
    "I need a Python function called `{f}` that {d}. Show what it gives for {x}.",
    "Can you write `{f}`? It {d}. Test it with {x}.",
]


def code_parts(rng: random.Random) -> tuple[str, str, str, str, str]:
    """(prompt, function name, code, example input, expected output) for one code task."""
    fname, desc, arg, body, make_input, ref = _pick(rng, CODE_TASKS)
    x = make_input(rng)
    code = f"def {fname}({arg}):\n" + "\n".join("    " + line for line in body)
    user = _pick(rng, CODE_ASKS).format(f=fname, d=desc, x=repr(x))
    return user, fname, code, repr(x), repr(ref(x))


def gen_code(rng: random.Random, style: str = "native") -> dict:
    """A code request answered with a function, an example and a short explanation."""
    user, fname, code, tin, tout = code_parts(rng)
    if style == "native":
        answer = f"```python\n{code}\n```\nExample: `{fname}({tin})` returns `{tout}`."
        extra = {
            "reasoning_content": f"I will write {fname} with a simple loop or slice and test it on {tin}."
        }
    else:
        answer = (
            f"Here is a possible implementation:\n\n```python\n{code}\n\nprint({fname}({tin}))  # {tout}\n```"
        )
        extra = {}
    return {
        "domain": "code",
        "messages": [_msg("user", user), _msg("assistant", answer, **extra)],
        "tools": None,
    }
