"""The one exception type for input the project refuses.

Every entry point (CLI, hook gRPC server, device plugin) turns an ``InputError`` into a user-facing
message (exit 1, ``INVALID_ARGUMENT``); anything else is a bug and reported as internal.
"""


class InputError(ValueError):
    """Input that is malformed or inconsistent; the message names the culprit."""
