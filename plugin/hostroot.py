"""The plugin's name for :mod:`runtime.hostroot`: reading a node's files under a host root as a chroot would.

The resolver moved to ``runtime/`` so that the node agent (which never imports the plugin) reads and writes
through the same one; the plugin's modules keep importing it from here.
"""

from __future__ import annotations

from runtime.hostroot import MAX_ATTRIBUTE_BYTES, MAX_LINKS, Directory, HostRoot, ReadError, SharedRoot

__all__ = ["MAX_ATTRIBUTE_BYTES", "MAX_LINKS", "Directory", "HostRoot", "ReadError", "SharedRoot"]
