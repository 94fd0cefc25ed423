"""Prompts whose token ids the router must make exactly as vLLM does: special characters,
special tokens' text, long documents, every chat-template feature the router renders, and a
long conversation followed by its next turn (the router reuses the first one's chunks)."""

from __future__ import annotations

from typing import Any

from tests.real.checks import documents

COMPLETIONS = [
    "Hello, world!",
    "  leading spaces, a\ttab and\n\nblank lines  ",
    "ünïcödé: 日本語のテキスト, emoji 🙂🚀, Ελληνικά, עברית, combining é",
    "<|begin_of_text|>a special token's text, then <|eot_id|> another",
    documents(1, 900, seed=7)[0],  # long: over a thousand tokens
]
LONG_TURN = [{"role": "user", "content": documents(1, 450, seed=9)[0]}]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse. ünï 字"},
            {"role": "user", "content": documents(1, 300, seed=8)[0]},
            {"role": "assistant", "content": "Noted."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "text", "text": "part two 🙂"},
                ],
            },
        ]
    },  # fmt: skip
    {"messages": [{"role": "user", "content": "no prompt"}], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "user", "content": "Finish this"},
            {"role": "assistant", "content": "Once upon a"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": "y", "name": "ann"},
        ]
    },
    # a long conversation, then its next turn: the router reuses the first one's chunks
    {"messages": LONG_TURN},
    {"messages": [*LONG_TURN, {"role": "assistant", "content": "Sure."}, *LONG_TURN]},
]
