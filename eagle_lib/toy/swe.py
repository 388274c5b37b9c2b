"""Toy SWE-agent sessions: long many-turn trajectories (up to ~84 messages), several runs per instance.

``gen_instance`` makes an issue; ``gen_run`` plays one agent run on it as a list of ``(role, text)`` turns with
nebius/SWE-agent-trajectories roles (system / user / ai). ``to_messages`` turns a run into an OpenAI-style
conversation for the target's training set.
"""

from __future__ import annotations

import random

from eagle_lib.toy.grammar import CODE_TASKS

SWE_SYSTEM = (
    "SETTING: You are an autonomous programmer working in a command line with a file viewer.\n"
    "COMMANDS:\nopen <path> - opens a file\ngoto <line> - moves the window to a line\n"
    "scroll_down - moves the window down\nsearch_file <text> - searches the open file\n"
    "find_file <name> - finds a file\nedit <start>:<end> - replaces lines, end with end_of_edit\n"
    "submit - submits your changes\n"
    "RESPONSE FORMAT: one DISCUSSION and then exactly one command in a code block."
)
REPOS = ["acme/toolkit", "bolt/datapipe", "cedar/webkit", "delta/numlite", "ember/cli"]
BUGS = [
    "returns the wrong value when the input is empty",
    "crashes on negative numbers",
    "is off by one for long inputs",
    "ignores the last element",
]
MODELS = ["swe-agent-llama-70b", "swe-agent-llama-8b", "swe-agent-llama-405b"]


def gen_instance(rng: random.Random, idx: int) -> dict:
    """One issue: repo, module file, buggy function (from the code tasks) and the issue text."""
    repo = REPOS[rng.randrange(len(REPOS))]
    fname, _, arg, body, _, _ = CODE_TASKS[rng.randrange(len(CODE_TASKS))]
    module = f"src/{fname.split('_')[0]}_utils.py"
    bug = BUGS[rng.randrange(len(BUGS))]
    return {
        "instance_id": f"{repo.replace('/', '__')}-{1000 + idx}",
        "repo": repo.split("/")[1],
        "module": module,
        "fname": fname,
        "code": [f"def {fname}({arg}):"] + ["    " + line for line in body],
        "issue": f"`{fname}` in {module} {bug}.\nSteps to reproduce: call `{fname}` with an edge case input.",
    }


def _listing(inst: dict, start: int) -> str:
    lines = ["import math", "", ""] + inst["code"] + ["", "", "def helper(x):", "    return x"]
    shown = lines[start : start + 12]
    return "\n".join(f"{start + i + 1}:{line}" for i, line in enumerate(shown))


def _footer(inst: dict, open_file: str) -> str:
    return f"(Open file: {open_file})\n(Current directory: /{inst['repo']})\nbash-$"


def _step(rng: random.Random, inst: dict, k: int) -> tuple[str, str, str]:
    """One agent step: (thought, command, observation)."""
    path = f"/{inst['repo']}/{inst['module']}"
    kind = ["find", "open", "search", "scroll", "goto", "run"][k % 6 if k < 6 else rng.randrange(6)]
    if kind == "find":
        name = inst["module"].split("/")[-1]
        obs = f'Found 1 matches for "{name}" in /{inst["repo"]}:\n{path}'
        return "Let me find the file that defines the function.", f'find_file "{name}"', obs
    if kind == "open":
        return "Let me open the file and read the function.", f"open {inst['module']}", _listing(inst, 0)
    if kind == "search":
        obs = f'Found 1 matches for "def {inst["fname"]}" in {path}:\nLine 4:def {inst["fname"]}'
        return "Let me search for the definition.", f'search_file "def {inst["fname"]}"', obs
    if kind == "scroll":
        return "Let me scroll down to see the rest of the file.", "scroll_down", _listing(inst, 6)
    if kind == "goto":
        line = rng.randint(1, 8)
        return f"Let me go to line {line}.", f"goto {line}", _listing(inst, line - 1)
    out = 'Traceback (most recent call last):\n  File "reproduce.py", line 3\nValueError: bad input'
    return (
        "Let me run the reproduction script again.",
        "python reproduce.py",
        out if rng.random() < 0.5 else "ok",
    )


def gen_run(rng: random.Random, inst: dict) -> dict:
    """One agent run on ``inst``: 4..41 steps (10..84 messages), ending in submit or running out of budget."""
    turns = [("system", SWE_SYSTEM), ("user", f"ISSUE:\n{inst['issue']}\n\n{_footer(inst, 'n/a')}")]
    n_steps = min(41, int(rng.expovariate(1 / 12)) + 4)
    open_file = "n/a"
    for k in range(n_steps - 1):
        thought, cmd, obs = _step(rng, inst, k)
        open_file = f"/{inst['repo']}/{inst['module']}" if k >= 1 else open_file
        turns += [
            ("ai", f"DISCUSSION\n{thought}\n\n```\n{cmd}\n```"),
            ("user", f"{obs}\n{_footer(inst, open_file)}"),
        ]
    submitted = rng.random() < 0.8
    last = "The fix is in place. Let me submit." if submitted else "I am running out of steps."
    turns.append(("ai", f"DISCUSSION\n{last}\n\n```\n{'submit' if submitted else 'exit_cost'}\n```"))
    patch = (
        f"diff --git a/{inst['module']} b/{inst['module']}\n--- a/{inst['module']}\n+++ b/{inst['module']}\n"
    )
    return {
        "turns": turns,
        "model_name": MODELS[rng.randrange(len(MODELS))],
        "exit_status": "submitted" if submitted else "submitted (exit_cost)",
        "generated_patch": patch + "@@ -4,1 +4,2 @@\n+    if not numbers:\n+        return 0\n"
        if submitted
        else "",
        "target": submitted and rng.random() < 0.5,
    }


def to_messages(run: dict) -> dict:
    """An agent run as a canonical OpenAI-style conversation (ai -> assistant)."""
    role = {"system": "system", "user": "user", "ai": "assistant"}
    msgs = [{"role": role[r], "content": t} for r, t in run["turns"]]
    return {"domain": "swe", "messages": msgs, "tools": None}
