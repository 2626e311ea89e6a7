"""A plain ``openai`` client scaffold, as a user would write one (tests/harness/test_scaffold.py).

It knows nothing of gyre-hpc beyond the environment a run gives it: the client reads
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` by itself; the task is ``GYRE_TASK_PROMPT``; the
commands it runs for the model go through ``$GYRE_SHELL -c``. Modes (argv[1]):

- ``turns`` (default): three chat turns, the second one carrying a command's output; then it
  fixes calc.py through the confined shell and exits 0.
- ``drop-middle``: four turns, the fourth sent with the second turn dropped from the history.
- ``forever``: chats until the run stops it (the turn budget).
- ``hang``: one call, then sleeps (the wall clock stops it).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import openai

MODEL = os.environ.get("GYRE_MODEL", "policy")


def shell(command: str) -> str:
    argv = shlex.split(os.environ["GYRE_SHELL"]) + ["-c", command]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return f"{done.stdout}[exit {done.returncode}]"


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "turns"
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "system", "content": "You fix code."},
                {"role": "user", "content": os.environ["GYRE_TASK_PROMPT"]}]

    def turn(msgs):
        reply = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
        return msgs + [{"role": "assistant", "content": reply.choices[0].message.content}]

    if mode == "hang":
        turn(messages)
        time.sleep(3600)
    if mode == "forever":
        while True:
            messages = turn(messages) + [{"role": "user", "content": "go on"}]
    messages = turn(messages)
    messages += [{"role": "user", "content": "ls says:\n" + shell("ls; id -u; cat /etc/hostname >/dev/null; pwd")}]
    messages = turn(messages)
    messages += [{"role": "user", "content": "now fix it"}]
    messages = turn(messages)
    if mode == "drop-middle":
        kept = messages[:3] + messages[5:]      # the second exchange is gone
        turn(kept + [{"role": "user", "content": "again"}])
    print(shell("printf 'def add(a, b):\\n    return a + b\\n' > calc.py && echo fixed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
