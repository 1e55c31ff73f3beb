"""Rendering ``<hostdev>`` elements: each kind's model (:mod:`launcher_hook.hostdevs`) owns its template.

The renderer builds every model's printf template once per layout and fills it per spec, so rendering stays a
string format on the OnDefineDomain path. It writes text, not lxml elements: the splicer can then insert it into
the original bytes unchanged (the fast path) or parse it into the tree (the general path), and both give the
same bytes. The one form written is the one that passes libvirt's RNG schema (docs/protocols.md, "libvirt
hostdev").
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

from launcher_hook.hostdevs import HOSTDEV_MODELS
from launcher_hook.hostdevs.base import HostdevSpec, Layout

__all__ = ["HostdevRenderer", "HostdevSpec", "Layout", "before_alias", "render_hostdev", "renderer_for"]

COMPACT = Layout()
"""No indentation, ``<x/>`` empty elements."""


def before_alias(text: str, address: str) -> str:
    """``text`` (a rendered hostdev, or a template) with ``address`` before its ``<alias>``, laid out like the
    alias."""
    at = text.rindex("<alias")
    whitespace = text[len(text[:at].rstrip()) : at]
    return text[:at] + address + whitespace + text[at:]


class HostdevRenderer:
    """Renders hostdevs for one layout: each kind's template is laid out once, each hostdev fills in its values.

    Every value is built from validated parts (hex numbers, a canonical UUID, an alias of ``[a-z0-9-]``, a
    driver from a fixed list), so nothing needs escaping.
    """

    def __init__(self, layout: Layout = COMPACT) -> None:
        driver = layout.driver()
        self._fill = {kind: (model.render, model.template(layout), driver) for kind, model in HOSTDEV_MODELS.items()}
        self._addressed = {kind: (fill[0], before_alias(fill[1], "%s"), driver) for kind, fill in self._fill.items()}
        """Each kind's template with a field for a guest ``<address>`` before the alias."""
        self._indent = layout.indent
        self._runs: dict[tuple[HostdevSpec, ...], str] = {}
        self._placed: dict[tuple[HostdevSpec, str], str] = {}
        self.kept: dict[Hashable, object] = {}
        """What a pass renders for this layout and keeps, keyed by everything it depends on (at most
        :data:`RUNS_KEPT` * 16 entries; the companions pass keeps each GPU's companion texts here)."""

    def __call__(self, spec: HostdevSpec) -> str:
        """The ``<hostdev>`` element for ``spec`` as XML text."""
        render, template, driver = self._fill[spec.kind]
        return render(template, driver, spec)

    def addressed(self, spec: HostdevSpec, address: str, *, keep: bool = False) -> str:
        """The ``<hostdev>`` element for ``spec`` with the guest ``address`` (an ``<address>`` element's text)
        before its alias: what ``before_alias(self(spec), address)`` gives, in one fill. ``keep``: the text is
        kept, as :meth:`run` keeps its texts."""
        key = (spec, address)
        text = self._placed.get(key) if keep else None
        if text is None:
            render, template, driver = self._addressed[spec.kind]
            text = render(template, driver, spec, address)
            if keep:
                if len(self._placed) >= RUNS_KEPT * 16:
                    self._placed.clear()
                self._placed[key] = text
        return text

    def keep(self, key: Hashable, value: object) -> None:
        """Keep ``value`` in :attr:`kept` under ``key`` (all are dropped when there are too many)."""
        if len(self.kept) >= RUNS_KEPT * 16:
            self.kept.clear()
        self.kept[key] = value

    def run(self, specs: Sequence[HostdevSpec]) -> str:
        """The elements for ``specs`` one after the other, each after the layout's indentation: the text the
        splicer inserts. The text of the last ``RUNS_KEPT`` lists is kept (the hook writes the same GPUs on
        every call of a pod), keyed by the specs themselves."""
        key = tuple(specs)
        text = self._runs.get(key)
        if text is None:
            indent, fill = self._indent, self._fill
            parts = []
            for spec in key:
                render, template, driver = fill[spec.kind]
                parts.append(indent + render(template, driver, spec))
            text = "".join(parts)
            if len(self._runs) >= RUNS_KEPT:
                self._runs.clear()
            self._runs[key] = text
        return text


RUNS_KEPT = 16
"""Rendered lists of hostdevs each renderer keeps (see :meth:`HostdevRenderer.run`)."""


@functools.lru_cache(maxsize=64)
def renderer_for(layout: Layout) -> HostdevRenderer:
    """The renderer of ``layout``, built once (a process sees a handful of layouts: its domains' indentation)."""
    return HostdevRenderer(layout)


def render_hostdev(spec: HostdevSpec, layout: Layout = COMPACT) -> str:
    """The ``<hostdev>`` element for ``spec`` as XML text, laid out like its surroundings."""
    return renderer_for(layout)(spec)
