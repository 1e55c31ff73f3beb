"""gRPC status messages fit to send: cut to a bounded length and always encodable as UTF-8.

gRPC sends the message percent-encoded in the trailers, and a client drops trailers over its metadata limit
(16 KiB hard) with ``RESOURCE_EXHAUSTED`` instead of the real status. Messages quote their input (a request's
IDs, a VMI's names), which may be long or carry lone surrogates (``\\ud800`` from JSON) that UTF-8 cannot
encode; gRPC would then fail the call with an unrelated error. Both servers send every message through here.
"""

from __future__ import annotations

MAX_STATUS_MESSAGE = 512
"""Longest status message sent, in characters: 512 stay under 8 KiB even when each is a 4-byte character."""


def status_message(message: str) -> str:
    """``message`` fit for a gRPC status: at most ``MAX_STATUS_MESSAGE`` characters (``...`` marks a cut),
    encodable as UTF-8 (characters it cannot encode are written as backslash escapes)."""
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 3] + "..."
    return message.encode("utf-8", "backslashreplace").decode("utf-8")
