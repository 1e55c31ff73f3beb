"""Input limits applied at every entry point that takes documents from outside."""

from schemas.errors import InputError

DEFAULT_MAX_INPUT_BYTES = 8 * 1024 * 1024
"""Largest domain XML or VMI JSON accepted (8 MiB); real KubeVirt domains are a few KiB."""


def check_utf8(data: bytes, what: str, max_bytes: int) -> str:
    """Refuse oversized or non-UTF-8 input, naming ``what``; return the decoded text."""
    if len(data) > max_bytes:
        raise InputError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not valid UTF-8: byte {exc.start} ({data[exc.start : exc.start + 1]!r})") from None
