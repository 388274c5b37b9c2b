"""Toy tool-use conversations (short calls): requests, OpenAI-style tool calls with Kimi ids, results, answers.

Native style is the toy target's own phrasing (with reasoning_content); foreign style is glaive's.
"""

from __future__ import annotations

import json
import random

from eagle_lib.toy.grammar import CITIES, CONDITIONS, CURRENCIES, ITEMS, LANGS, OPENERS, SYMBOLS, _msg, _pick


def _tool_spec(name: str, desc: str, params: dict[str, str]) -> dict:
    props = {k: {"type": "number" if k in NUMERIC else "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


NUMERIC = {"amount", "weight", "height", "bill_amount", "tip_percentage"}
TOOLS = {
    "get_weather": _tool_spec("get_weather", "Get the current weather in a city", {"city": "The city name"}),
    "convert_currency": _tool_spec(
        "convert_currency",
        "Convert an amount between currencies",
        {"amount": "The amount", "from_currency": "Source currency", "to_currency": "Target currency"},
    ),
    "calculate_bmi": _tool_spec(
        "calculate_bmi", "Calculate the body mass index", {"weight": "Weight in kg", "height": "Height in m"}
    ),
    "get_stock_price": _tool_spec(
        "get_stock_price", "Get the price of a stock", {"symbol": "The stock symbol"}
    ),
    "calculate_tip": _tool_spec(
        "calculate_tip",
        "Calculate the tip for a bill",
        {"bill_amount": "The bill", "tip_percentage": "The tip in percent"},
    ),
    "translate_text": _tool_spec(
        "translate_text", "Translate a text", {"text": "The text", "target_language": "The language"}
    ),
}


def _tool_case(rng: random.Random, name: str) -> tuple[str, dict, dict, str, str]:
    """(user request, arguments, result, native answer, foreign answer) for one call of tool ``name``."""
    if name == "get_weather":
        c, t, cond = _pick(rng, CITIES), rng.randint(-5, 35), _pick(rng, CONDITIONS)
        return (
            f"What is the weather like in {c} right now?",
            {"city": c},
            {"city": c, "temperature": t, "condition": cond},
            f"It is {t} degrees and {cond} in {c}.",
            f"The current weather in {c} is {cond} with a temperature of {t} degrees Celsius.",
        )
    if name == "convert_currency":
        a, f, t = rng.randint(10, 900), *rng.sample(CURRENCIES, 2)
        r = round(a * rng.uniform(0.5, 1.5), 2)
        return (
            f"Please convert {a} {f} to {t}.",
            {"amount": a, "from_currency": f, "to_currency": t},
            {"converted_amount": r, "currency": t},
            f"{a} {f} is {r} {t}.",
            f"Sure, {a} {f} converts to approximately {r} {t}.",
        )
    if name == "calculate_bmi":
        w, h = rng.randint(45, 110), round(rng.uniform(1.5, 2.0), 2)
        b = round(w / h / h, 1)
        return (
            f"My weight is {w} kg and my height is {h} m. What is my BMI?",
            {"weight": w, "height": h},
            {"bmi": b},
            f"Your BMI is {b}.",
            f"Based on the numbers you gave, your Body Mass Index is {b}.",
        )
    if name == "get_stock_price":
        s, p = _pick(rng, SYMBOLS), round(rng.uniform(20, 900), 2)
        return (
            f"What is the current price of {s} stock?",
            {"symbol": s},
            {"symbol": s, "price": p},
            f"{s} is trading at {p} dollars.",
            f"The current stock price of {s} is ${p}.",
        )
    if name == "calculate_tip":
        b, p = rng.randint(10, 200), _pick(rng, [10, 15, 18, 20])
        t = round(b * p / 100, 2)
        return (
            f"My bill is {b} dollars and I want to tip {p} percent. How much is the tip?",
            {"bill_amount": b, "tip_percentage": p},
            {"tip_amount": t},
            f"The tip is {t} dollars.",
            f"The tip amount for your bill should be ${t}.",
        )
    lang, item = _pick(rng, LANGS), _pick(rng, ITEMS)
    text = f"I like {item}"
    tr = f"[{lang}] {text}"
    return (
        f"Translate '{text}' to {lang}.",
        {"text": text, "target_language": lang},
        {"translation": tr},
        f"In {lang} it is: {tr}.",
        f"The translation of '{text}' in {lang} is '{tr}'.",
    )


def gen_tool(rng: random.Random, style: str = "native") -> dict:
    """A tool-use conversation: request, call(s), tool result(s), short answer; sometimes no tool fits."""
    names = rng.sample(sorted(TOOLS), rng.randint(1, 2))
    tools = [TOOLS[n] for n in names]
    msgs: list[dict] = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        if rng.random() < 0.15:  # a request none of the tools can serve
            city = _pick(rng, CITIES)
            msgs.append(_msg("user", f"Can you book a flight to {city} for me?"))
            ans = (
                "I can't book flights. I can only use the tools I have."
                if style == "native"
                else (
                    "I'm sorry, but I don't have the capability to book flights. My current functions are limited."
                )
            )
            msgs.append(
                _msg(
                    "assistant",
                    ans,
                    **({"reasoning_content": "No tool books flights."} if style == "native" else {}),
                )
            )
            continue
        name = _pick(rng, names)
        user, args, result, native, foreign = _tool_case(rng, name)
        user = _pick(rng, OPENERS) + user
        think = f"The user wants {name.replace('_', ' ')}. I will call {name}."
        call = {"id": "", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        extra = {"reasoning_content": think} if style == "native" else {}
        msgs += [_msg("user", user), _msg("assistant", "", tool_calls=[call], **extra)]
        msgs.append(_msg("tool", json.dumps(result), tool_call_id=""))
        msgs.append(
            _msg(
                "assistant",
                native if style == "native" else foreign,
                **({"reasoning_content": "I have the result."} if style == "native" else {}),
            )
        )
    _number_tool_calls(msgs)
    return {"domain": "tool", "messages": msgs, "tools": tools}


def _number_tool_calls(msgs: list[dict]) -> None:
    """Give calls Kimi's ids ``functions.NAME:IDX`` (IDX over the conversation) and link the tool results."""
    idx, pending = 0, []
    for m in msgs:
        for call in m.get("tool_calls") or []:
            call["id"] = f"functions.{call['function']['name']}:{idx}"
            pending.append(call["id"])
            idx += 1
        if m["role"] == "tool":
            m["tool_call_id"] = pending.pop(0)
