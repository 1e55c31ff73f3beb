"""A ValidatingAdmissionPolicy's CEL evaluated with cel-python as the API server's admission plugin runs it, for
the tests of deploy/'s policies (the DRA plugin's slices, the node agent's Node).

Match conditions first (a request they do not match is not the policy's business: ``(False, [])``), then the
policy's variables in order, each seeing the ones before it, then every validation: one that is not exactly
``true`` (false, an error, not a boolean) denies, and its message (``messageExpression`` evaluated, else
``message``) is returned. The requests the tests build must look as the API server's do (no ``subResource`` key
for a request on the object itself): the real API server is the judge, this is the fast check beside it
(tests/cluster exercises the policies there).
"""

from __future__ import annotations

from typing import Any

import celpy
import celpy.adapter
import celpy.celtypes


class AdmissionPolicy:
    """The policy's expressions compiled once."""

    def __init__(self, doc: dict[str, Any]) -> None:
        environment = celpy.Environment()

        def compiled(expression: str) -> Any:
            return environment.program(environment.compile(expression))

        spec = doc["spec"]
        self.spec = spec
        self.conditions = [compiled(item["expression"]) for item in spec.get("matchConditions", [])]
        self.variables = [(item["name"], compiled(item["expression"])) for item in spec.get("variables", [])]
        self.validations = [
            (
                compiled(item["expression"]),
                compiled(item["messageExpression"]) if "messageExpression" in item else None,
                item.get("message", "denied"),
            )
            for item in spec["validations"]
        ]

    def admit(self, request: dict[str, Any], obj: Any, old: Any) -> tuple[bool, list[str]]:
        """(matched, the messages of the validations that denied)."""
        activation: dict[str, Any] = {
            "request": celpy.adapter.json_to_cel(request),
            "object": celpy.adapter.json_to_cel(obj),
            "oldObject": celpy.adapter.json_to_cel(old),
        }
        if not all(bool(condition.evaluate(activation)) for condition in self.conditions):
            return False, []
        values: dict[Any, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celpy.celtypes.MapType(values)
            values[celpy.celtypes.StringType(name)] = program.evaluate(activation)
        activation["variables"] = celpy.celtypes.MapType(values)
        failed: list[str] = []
        for check, message, text in self.validations:
            result = check.evaluate(activation)
            if isinstance(result, celpy.celtypes.BoolType) and result:
                continue
            if not isinstance(result, celpy.celtypes.BoolType):
                failed.append(f"evaluation error: {result!r}")
            else:
                failed.append(str(message.evaluate(activation)) if message is not None else text)
        return True, failed
