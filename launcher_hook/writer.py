"""Step 3 of a call: the one writer of the domain the passes edited.

Every pass (:mod:`launcher_hook.domain`'s hostdev merge, :mod:`launcher_hook.companions`,
:mod:`launcher_hook.mmio_window`) edits the one parsed document of the call (:mod:`launcher_hook.document`)
through this writer; it applies all their edits once, in one of two ways:

- splice (the usual KubeVirt domain): the original bytes with each edit's bytes put in at the place it names
  (an insertion, a cut, a hostdev re-serialised alone); every other byte stays as it came, for every pass at
  once. Possible while the document is elements and text only and every place is unambiguous in the bytes;
- serialise (otherwise: comments, CDATA, a removed hostdev, two ``<devices>``, a place a pass cannot find in
  the bytes): the tree, which every edit also changed, serialised with the original prolog, root start tag and
  empty-element style (``ParsedDomain.serialize``).

An edit is made on the tree when the pass makes it, except where the bytes alone say all (virt-launcher's
hostdev forms, the hook's new hostdevs): those keep their tree change as a ``tree_fix`` (made only if the tree
is serialised) or are pending :class:`NewHostdev` elements the writer renders, so the common path touches the
tree as little as the old byte paths did. Applied to its own output, the passes find nothing to change and the
writer returns the input bytes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lxml import etree

from launcher_hook.document import (
    ParsedDomain,
    append_child,
    child_slots,
    element_bytes,
    hostdev_spans,
    indent_unit,
)
from launcher_hook.hostdev import HostdevRenderer, HostdevSpec, Layout, renderer_for

Splice = tuple[int, int, bytes]
"""Bytes ``[start, end)`` of the original replaced by the text (``start == end``: an insertion)."""


class NewHostdev:
    """A hostdev the merge adds, not yet in the tree: what later passes add in and around it (a guest address
    before its alias, elements before and after it) is kept here and rendered with it. (A plain class with
    slots: one is made per GPU on the OnDefineDomain path.)"""

    __slots__ = ("address", "after", "before", "spec")

    def __init__(self, spec: HostdevSpec) -> None:
        self.spec = spec
        self.address: str | None = None
        self.before: list[str] = _NONE
        self.after: list[str] = _NONE

    def add_before(self, text: str) -> None:
        self.before = [*self.before, text]

    def add_after(self, texts: Sequence[str]) -> None:
        self.after = [*self.after, *texts]

    def texts(self, render: HostdevRenderer) -> list[str]:
        """Its elements in document order, each laid out by ``render`` (the renderer of the run's layout)."""
        text = render(self.spec) if self.address is None else render.addressed(self.spec, self.address)
        return [*self.before, text, *self.after] if self.before or self.after else [text]


_NONE: list[str] = []
"""The shared empty list of a :class:`NewHostdev` nothing was added around (never appended to)."""


@dataclass
class _NewRun:
    """The new hostdevs, appended to the last ``<devices>``: where (None: not found in the bytes) and how."""

    devices: etree._Element
    layout: Layout
    at: int | None
    items: list[NewHostdev]


Handle = etree._Element | NewHostdev
"""A hostdev of the output: one of the domain's (an element) or one the merge adds."""


class DomainWriter:
    """The edits of one call's passes on ``parsed``, and the one place they are written (:meth:`result`)."""

    def __init__(self, parsed: ParsedDomain, *, allow_fast: bool = True) -> None:
        self.parsed = parsed
        self.fast = allow_fast and parsed.has_only_elements_and_text
        """Whether the edits are still all splices (see the module docstring)."""
        self.changed = False
        self._unit: str | None = None
        self.new_decorated = False
        """Whether a pass added something in or around a :class:`NewHostdev` (else the run is rendered whole)."""
        self.in_order: list[etree._Element] | None = None
        """The hostdevs of ``<devices>`` in order, when a pass has them (finding their bytes is then quicker)."""
        self._splices: list[Splice] = []
        self._tree_fixes: list[Callable[[], None]] = []
        self._reserialised: dict[int, tuple[etree._Element, bool]] = {}
        self._run: _NewRun | None = None
        self._late: list[Callable[[bool], list[Splice]]] = []
        self._after_serialise: list[Callable[[bytes], bytes]] = []
        self._layouts: dict[tuple[str, bool], Layout] = {}
        self._spans: tuple[dict[int, tuple[int, int]], list[etree._Element]] | bool | None = False

    @property
    def unit(self) -> str:
        """The document's indentation step."""
        if self._unit is None:
            self._unit = indent_unit(self.parsed.root)
        return self._unit

    def no_fast(self) -> None:
        """A pass's edit cannot be placed in the bytes: the tree is serialised."""
        self.fast = False

    def tree_changed(self) -> None:
        """A pass changed the tree (and, while ``fast``, recorded the same change in the bytes)."""
        self.changed = True

    # ---- where things are in the original bytes ----------------------------------------------------------

    def hostdev_span(self, hostdev: etree._Element) -> tuple[int, int] | None:
        """Where the element named hostdev is in the original bytes, or None (not found unambiguously)."""
        if self._spans is False:
            self._spans = hostdev_spans(self.parsed, self.in_order)
        spans = self._spans
        return spans[0].get(id(hostdev)) if isinstance(spans, tuple) else None

    def know_spans(self, spans: dict[int, tuple[int, int]], elements: list[etree._Element]) -> None:
        """Where the hostdevs ``elements`` are in the bytes, as a pass read them (``spans``, by ``id``)."""
        if self._spans is False and len(spans) == len(elements):
            self._spans = (spans, elements)

    def layout_at(self, indent: str, offset: int | None) -> Layout:
        """The layout of a new element with indentation ``indent`` written at ``offset`` of the original bytes
        (None: at the end; the empty-element style of its neighbours)."""
        near = offset if offset is not None else len(self.parsed.source)
        key = (indent, self.parsed.writes_empty_expanded_near(near))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Layout(indent, self.unit if indent else "", key[1])
        return layout

    @property
    def new_layout(self) -> Layout:
        """The layout of the hostdevs the merge adds (and of what later passes add around them)."""
        assert self._run is not None
        return self._run.layout

    # ---- edits -------------------------------------------------------------------------------------------

    def splice(self, start: int, end: int, text: bytes, tree_fix: Callable[[], None] | None = None) -> None:
        """Replace ``[start, end)`` of the original bytes with ``text``; ``tree_fix`` makes the same change on the
        tree, and is made only if the tree is serialised (None: the pass changed the tree itself)."""
        self.changed = True
        self._splices.append((start, end, text))
        if tree_fix is not None:
            self._tree_fixes.append(tree_fix)

    def splice_all(self, splices: Sequence[Splice], tree_fix: Callable[[], None]) -> None:
        """:meth:`splice` of each of ``splices``, with one ``tree_fix`` making all their changes on the tree."""
        self.changed = True
        self._splices += splices
        self._tree_fixes.append(tree_fix)

    def reserialise(self, hostdev: etree._Element, expanded_empty: bool) -> None:
        """Write ``hostdev`` (changed on the tree) anew from the tree, in its place in the bytes."""
        self.changed = True
        if not self.fast:
            return
        if self.hostdev_span(hostdev) is None:
            self.no_fast()
            return
        self._reserialised[id(hostdev)] = (hostdev, expanded_empty)

    def insert_around(
        self,
        hostdev: etree._Element,
        before: str = "",
        after: str = "",
        inside: tuple[Callable[[bytes], int | None], str] | None = None,
        fix_around: Callable[[], None] | None = None,
        fix_inside: Callable[[], None] | None = None,
    ) -> None:
        """One pass's insertions at one hostdev, found in the bytes once: ``before`` (elements) just before it,
        ``after`` just after it, ``inside[1]`` inside it at the offset ``inside[0]`` finds in its original bytes
        (None: not found; the tree is serialised); ``fix_around`` and ``fix_inside`` make the same changes on
        the tree. A hostdev written anew from the tree needs no insertion inside (its ``fix_inside`` is made
        before it is written)."""
        self.changed = True
        fast = self.fast
        if inside is not None and fast and id(hostdev) in self._reserialised:
            fix_inside()  # type: ignore[misc]
            inside = fix_inside = None
        if fix_around is not None:
            self._tree_fixes.append(fix_around)
        if fix_inside is not None:
            self._tree_fixes.append(fix_inside)
        if not fast:
            return
        span = self.hostdev_span(hostdev)
        if span is None:
            self.no_fast()
            return
        start, end = span
        splices = self._splices
        if before:
            splices.append((start, start, before.encode()))
        if inside is not None:
            offset = inside[0](self.parsed.source[start:end])
            if offset is None:
                self.no_fast()
                return
            splices.append((start + offset, start + offset, inside[1].encode()))
        if after:
            splices.append((end, end, after.encode()))

    def add_hostdevs(self, devices: etree._Element, items: list[NewHostdev], layout: Layout, at: int | None) -> None:
        """Append ``items`` to ``devices`` (the last ``<devices>``): inserted at ``at`` of the bytes, laid out
        for ``layout`` (None: not placeable in the bytes; the tree is serialised)."""
        self.changed = True
        self._run = _NewRun(devices, layout, at, items)
        if at is None:
            self.no_fast()

    def late(self, splices: Callable[[bool], list[Splice]], tree_edit: Callable[[], None]) -> None:
        """Splices that depend on the output's empty-element style (``True``: ``<x></x>`` throughout), given
        when the rest is known; ``tree_edit`` makes the same change on the tree."""
        self.changed = True
        self._late.append(splices)
        self._tree_fixes.append(tree_edit)

    def after_serialise(self, edit: Callable[[bytes], bytes]) -> None:
        """An edit of the serialised bytes (the tree cannot take it: a namespace declaration the root lacks)."""
        self.changed = True
        self._after_serialise.append(edit)

    # ---- writing -----------------------------------------------------------------------------------------

    def result(self) -> bytes:
        """The domain with every pass's edits, written once."""
        if not self.changed:
            return self.parsed.source
        if self.fast:
            written = self._spliced()
            if written is not None:
                return written
        return self._serialised()

    def _run_text(self, run: _NewRun) -> str:
        render = renderer_for(run.layout)
        if not self.new_decorated:
            return render.run([item.spec for item in run.items])
        texts: list[str] = []
        for item in run.items:
            spec, address = item.spec, item.address
            if item.before:
                texts += item.before
            texts.append(render(spec) if address is None else render.addressed(spec, address, keep=True))
            if item.after:
                texts += item.after
        indent = run.layout.indent  # before each element
        return indent + indent.join(texts)

    def _spliced(self) -> bytes | None:
        source = self.parsed.source
        edits = list(self._splices)
        replaced: list[tuple[int, int]] = []
        for hostdev, expanded in self._reserialised.values():
            span = self.hostdev_span(hostdev)
            assert span is not None  # (checked when it was recorded)
            edits.append((span[0], span[1], element_bytes(hostdev, expanded)))
            replaced.append(span)
        if replaced:  # insertions the tree already has inside a hostdev written anew
            edits = [
                edit
                for edit in edits
                if not any(start < edit[0] < end or (start < edit[1] < end) for start, end in replaced)
                or (edit[0], edit[1]) in replaced
            ]
        run = self._run
        if run is not None and run.items:
            assert run.at is not None
            edits.append((run.at, run.at, self._run_text(run).encode()))
        written = _apply(source, edits)
        if written is None or not self._late:
            return written
        expanded = b"/>" not in written and b"></" in written
        late = [splice for producer in self._late for splice in producer(expanded)]
        return _apply(written, [(_moved(start, edits), _moved(end, edits), text) for start, end, text in late])

    def _serialised(self) -> bytes:
        for fix in self._tree_fixes:
            fix()
        self._tree_fixes.clear()
        run = self._run
        if run is not None:
            render = renderer_for(run.layout)
            for item in run.items:
                for text in item.texts(render):
                    before, closing = child_slots(run.devices, self.unit)
                    append_child(run.devices, etree.fromstring(text), before, closing)
            self._run = None
        written = self.parsed.serialize()
        for edit in self._after_serialise:
            written = edit(written)
        return written


_PLACE = operator.itemgetter(0, 1)


def _apply(source: bytes, edits: Sequence[Splice]) -> bytes | None:
    """``source`` with ``edits`` made, or None when two overlap."""
    pieces: list[bytes] = []
    position = 0
    for start, end, text in sorted(edits, key=_PLACE):  # (stable: insertions at one place keep their order)
        if start < position:
            return None
        pieces += (source[position:start], text)
        position = end
    pieces.append(source[position:])
    return b"".join(pieces)


def _moved(offset: int, edits: Sequence[Splice]) -> int:
    """Where ``offset`` of the original is once ``edits`` are made (none of them spans it)."""
    return offset + sum(len(text) - (end - start) for start, end, text in edits if end <= offset)
