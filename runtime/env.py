"""The environment variables each component owns, by prefix.

``GPU_PLUGIN_*`` belong to the device plugin (every configuration key and flag; an unknown one is an error);
``LAUNCHER_HOOK_*`` to the hook sidecar and its ``onDefineDomain`` shim. The allocation variables
(``PCI_RESOURCE_*``…) are KubeVirt's, named by :mod:`schemas.kinds`. Naming a variable through these helpers
keeps each prefix in one place.
"""

from __future__ import annotations

PLUGIN_ENV_PREFIX = "GPU_PLUGIN_"
HOOK_ENV_PREFIX = "LAUNCHER_HOOK_"


def plugin_env(key: str) -> str:
    """The plugin's variable for a configuration key or flag: ``log_format`` → ``GPU_PLUGIN_LOG_FORMAT``."""
    return PLUGIN_ENV_PREFIX + key.upper().replace("-", "_")


def hook_env(key: str) -> str:
    """The hook's variable for a flag: ``log_format`` → ``LAUNCHER_HOOK_LOG_FORMAT``."""
    return HOOK_ENV_PREFIX + key.upper().replace("-", "_")
