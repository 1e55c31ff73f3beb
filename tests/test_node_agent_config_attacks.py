"""Attacks on ``vgpu apply``'s config (node_agent/vgpu_config.py): a small file whose YAML aliases expand to a
huge value must be refused with a short message naming the entry, not printed whole (the first round's error
put the value's repr in the message: a 1 KiB file with nine levels of aliases made the agent exhaust memory)."""

from __future__ import annotations

import pytest

from node_agent.kernel import AgentError
from node_agent.vgpu_config import parse_config


def _aliases(levels: int, field: str) -> str:
    """A config whose ``field`` is ``levels`` nested lists of nine aliases each: 9**levels leaves from a few
    hundred bytes."""
    value = '&a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]'
    for level in range(1, levels):
        value = f"&a{level} [{value}" + f", *a{level - 1}" * 8 + "]"
    entry = {"devices": "all", "vgpu-devices": "{T4-1Q: 1}", field: value}
    lines = "".join(f"      {key}: {text}\n" for key, text in entry.items()).replace("      ", "    - ", 1)
    return f"version: v1\nvgpu-configs:\n  bomb:\n{lines}"


@pytest.mark.parametrize("field", ["devices", "vgpu-devices", "device-filter"])
def test_an_alias_bomb_is_refused_with_a_short_message(field: str) -> None:
    text = _aliases(6, field)  # 531441 leaves: its repr is megabytes, its file well under a kilobyte
    assert len(text) < 1024
    with pytest.raises(AgentError) as refused:
        parse_config(text, "vgpu.yaml")
    message = str(refused.value)
    assert "vgpu.yaml, bomb[0]" in message
    assert len(message) < 1000
